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
    compiled(torch.randn(8))
    from tqdm import tqdm

    if tqdm.monitor is not None:  # Inductor's progress bar started tqdm's monitor thread; a new bar starts another
        tqdm.monitor.exit()
    started = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    if started:  # a fork copies no thread: a lock one of them held would stay held in every cell
        raise RuntimeError(f"compiling in the zygote started threads {started}")


_warm()
