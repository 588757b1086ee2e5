"""The short form of `benchmarks/chaos.py`: SIGKILL at random moments (and inside checkpoint saves, and on one of
two torchrun ranks), resume, again, until the run finishes: its losses equal the undisturbed run's bit for bit, at
most one `.tmp` directory is ever left, `keep_last` holds, and every step is in metrics.jsonl once."""

from __future__ import annotations

import pytest

from benchmarks.chaos import run_chaos, run_undisturbed, start_process
from tests import forks


def forked(nproc: int, args: list[str], env: dict[str, str], cwd):
    """An attempt forked from the worker's zygote (`tests.forks`), ranks with torchrun's variables: what a fresh
    process would do, without its seconds of imports."""
    return forks.start(["train", *args], cwd, env, nproc if nproc > 1 else 0) or start_process(nproc, args, env, cwd)


@pytest.mark.parametrize("nproc,kills,async_mode", [(1, 5, "async"), (2, 2, "off")])
def test_killed_again_and_again_ends_bit_identical(tmp_path, nproc, kills, async_mode):
    """One process saves with `async_mode = async`: the kills inside saves hit background writes (the fault points
    run in the save's thread); two ranks save synchronously, under real torchrun, whose agent ends the other rank
    when one is killed. The undisturbed runs save synchronously: their losses are the reference for both."""
    steps, interval, keep_last = 15, 3, 2
    reference = run_undisturbed(tmp_path, nproc, steps, interval, keep_last, start=forked)
    result = run_chaos(tmp_path, kills=kills, seed=nproc, nproc=nproc, steps=steps, interval=interval,
                       keep_last=keep_last, timeout=600, async_mode=async_mode,
                       start=forked if nproc == 1 else start_process)
    assert result["kills"] >= kills
    assert result["losses"] == reference
