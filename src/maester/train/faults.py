"""Fault injection for tests: `_MAESTER_FAULT=<point>:<step>[@<rank>][,...]` makes the fault happen at that step
(on that rank only, with `@rank`).

Points: `after_step` (SIGKILL after the optimizer step), `during_save` (SIGKILL with the checkpoint files partly
written), `before_manifest` (SIGKILL with every file but the manifest written), `before_latest` (SIGKILL after
the rename, before `latest` moves), `nan_loss` (the step's loss becomes NaN before backward), `hang` (sleep
`_MAESTER_HANG_SECONDS`, default 600, after the step: a rank that stops answering collectives; or until the file
`_MAESTER_HANG_UNTIL` exists, for a test that acts while the run stands still; it logs a warning as it begins),
`slow_write` (the same wait inside the write of the step's checkpoint, after its DCP files: with
`checkpoint.async_mode` async, a background write that is still in flight).

`_MAESTER_FAULT_ONCE=<file>`: only the first fault due happens (it creates the file, exclusively; no fault happens
while the file exists), so a restarted run goes past it: a job that crashes once, then resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from maester.files import create_new

ENV = "_MAESTER_FAULT"
ONCE_ENV = "_MAESTER_FAULT_ONCE"


def fault_at(point: str, step: int) -> bool:
    spec = os.environ.get(ENV)
    if not spec:
        return False
    rank = os.environ.get("RANK", "0")
    for item in spec.split(","):
        where, _, only_rank = item.partition("@")
        if where == f"{point}:{step}" and (not only_rank or only_rank == rank):
            return _first_run()
    return False


def _first_run() -> bool:
    """False when `_MAESTER_FAULT_ONCE` names a file an earlier run created; creates it otherwise."""
    once = os.environ.get(ONCE_ENV)
    return not once or create_new(Path(once))


def maybe_crash(point: str, step: int) -> None:
    if fault_at(point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_hang(step: int, point: str = "hang") -> None:
    if fault_at(point, step):
        seconds = float(os.environ.get("_MAESTER_HANG_SECONDS", "600"))
        deadline = time.monotonic() + seconds
        until = os.environ.get("_MAESTER_HANG_UNTIL")
        # what a test waits for before it acts on a run that stands still
        logging.getLogger("maester").warning("fault injection (%s): standing still at step %d for %g s%s", point,
                                             step, seconds, f" or until {until} exists" if until else "")
        while time.monotonic() < deadline and not (until and Path(until).exists()):
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
