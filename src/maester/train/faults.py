"""Fault injection for tests: `_MAESTER_FAULT=<point>:<step>` kills the process with SIGKILL at that point.

Points: `after_step` (after the optimizer step), `during_save` (checkpoint files partly written).
"""

from __future__ import annotations

import os
import signal

ENV = "_MAESTER_FAULT"


def maybe_crash(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
