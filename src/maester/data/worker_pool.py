"""Map a function over chunks in worker processes, in input order, reading only a little ahead."""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

_worker: Callable | None = None


def ignore_stop_signals(_worker_id: int | None = None) -> None:
    """In a loader worker: leave SIGTERM and SIGINT to the main process. SLURM signals the whole process group on
    requeue, preemption and time limit, and Ctrl-C reaches every process of the terminal; the main process stops
    the run (checkpoint, requeue marker) and then ends its workers itself. DataLoader's `worker_init_fn`."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(factory: Callable, args: tuple) -> None:
    """A pool worker ignores SIGINT and SIGTERM: the main process reports a Ctrl-C or a SIGTERM once and shuts the
    pool down, and a worker is never killed while it may hold a lock of the pool's queues. It starts with both
    blocked (`_stops_held`), so a Ctrl-C while it starts up cannot break its imports."""
    import signal

    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    _worker = factory(*args)


def _run(chunk):
    assert _worker is not None
    return _worker(chunk)


def chunked(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def map_in_order(factory: Callable, args: tuple, chunks: Iterable, workers: int) -> Iterator:
    """`factory(*args)(chunk)` for each chunk, in input order. With workers > 1, each worker process builds its own
    `factory(*args)` once and at most 2 * workers chunks are in flight.

    On an exception here (Ctrl-C, or SIGTERM turned into one) the pool is shut down, not terminated: the chunks
    being encoded finish, the rest are cancelled, and the workers exit. `multiprocessing.Pool.terminate` kills
    workers, and one killed while it holds the result queue's lock hangs the pool's own shutdown for ever."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if workers == 1:
        yield from map(factory(*args), chunks)
        return
    if "forkserver" in multiprocessing.get_all_start_methods():  # no fork of a process that may hold threads
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__, factory.__module__])  # imported once, not per worker
    else:
        context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start, initargs=(factory, args))
    in_flight: collections.deque = collections.deque()
    try:
        for chunk in chunks:
            in_flight.append(_submit(pool, chunk))
            if len(in_flight) >= 2 * workers:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _submit(pool: ProcessPoolExecutor, chunk) -> Future:
    """Workers (and the forkserver) start inside `submit`. A Ctrl-C or SIGTERM in the middle of it would leave a
    worker the pool does not know yet, which then fails to read the pool's queues once they are gone; so a stop
    that comes meanwhile is held and handled when `submit` returns."""
    with _stops_held():
        return pool.submit(_run, chunk)


@contextlib.contextmanager
def _stops_held():
    """Hold SIGINT and SIGTERM: the processes started meanwhile inherit them blocked (until `_start` ignores
    them), and in this process the first one that came is handled on the way out. Python runs signal handlers in
    the main thread whatever thread the signal reached, so the handlers are swapped too, not only the mask."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    handlers = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in _STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if held:
            signal.raise_signal(held[0])
