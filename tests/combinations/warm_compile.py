"""Imported by the matrix's training zygote after torch: one small `torch.compile` of a function of its own (forward
only: a backward starts autograd's threads, and a fork of a process that has them fails its first backward), so
that what Dynamo and Inductor set up on a process's first compile is done once, before the zygote forks the cells'
ranks, not again in each of them (warm cache, the 8 processes of an HSDP cell: 23.2 -> 14.9 CPU s). The function
shares nothing with a cell's graphs; each cell still compiles its own, from the cache on disk or not."""

from __future__ import annotations

import threading

import torch


def _warm() -> None:
    before = set(threading.enumerate())
    compiled = torch.compile(lambda x: (x * 2).sin() + x.cos())
    compiled(torch.ones(8))  # not randn: the zygote's generator stays as a fresh process's
    _forget_tqdm()
    started = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    if started:  # a fork copies no thread: a lock one of them held would stay held in every cell
        raise RuntimeError(f"compiling in the zygote started threads {started}")


def _forget_tqdm() -> None:
    """Inductor's progress bar started tqdm's monitor thread and made its locks, one of them a multiprocessing lock
    that every fork would share (a rank SIGKILLed while holding it would block the bars of all later cells): the
    thread ends and the locks go, so that each fork makes its own, as a fresh process does."""
    from tqdm import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    classes = [tqdm]
    for cls in classes:
        classes.extend(cls.__subclasses__())
        if vars(cls).get("monitor") is not None:
            cls.monitor.exit()
            cls.monitor = None
        if "_lock" in vars(cls):
            del cls._lock
    if "mp_lock" in vars(TqdmDefaultWriteLock):
        del TqdmDefaultWriteLock.mp_lock


_warm()
