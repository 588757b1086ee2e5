"""Map a function over chunks in worker processes, in input order, reading only a little ahead."""

from __future__ import annotations

import itertools
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

_worker: Callable | None = None


def ignore_stop_signals(_worker_id: int | None = None) -> None:
    """In a loader worker: leave SIGTERM and SIGINT to the main process. SLURM signals the whole process group on
    requeue, preemption and time limit, and Ctrl-C reaches every process of the terminal; the main process stops
    the run (checkpoint, requeue marker) and then ends its workers itself. DataLoader's `worker_init_fn`."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(factory: Callable, args: tuple) -> None:
    """A pool worker ignores Ctrl-C (the main process reports it once and ends the pool with SIGTERM). It starts
    with SIGINT blocked (see `map_in_order`), so a Ctrl-C while it starts up cannot break its imports."""
    import signal

    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
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
    `factory(*args)` once and at most 2 * workers chunks are read ahead (Pool.imap alone would read the whole
    input into memory)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if workers == 1:
        yield from map(factory(*args), chunks)
        return
    window = threading.Semaphore(2 * workers)
    stop = threading.Event()

    def read_ahead() -> Iterator:  # runs in the pool's task thread
        for chunk in chunks:
            while not window.acquire(timeout=0.1):
                if stop.is_set():
                    return
            yield chunk

    if "forkserver" in multiprocessing.get_all_start_methods():  # no fork of a process that may hold threads
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__, factory.__module__])  # imported once, not per worker
    else:
        context = multiprocessing.get_context("spawn")
    # The workers (and the forkserver) inherit a blocked SIGINT, until _start ignores it; here a Ctrl-C waits
    # until the pool is up, then interrupts as usual.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = context.Pool(workers, initializer=_start, initargs=(factory, args))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        for result in pool.imap(_run, read_ahead()):
            window.release()
            yield result
        pool.close()
        pool.join()
    finally:
        stop.set()
        pool.terminate()
        pool.join()
