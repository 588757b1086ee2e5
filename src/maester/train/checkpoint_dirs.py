"""A job's checkpoint directories by name, without torch (for `maester status`): `step-<N>`, which of them are
complete, the newest."""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"


def is_complete(path: Path) -> bool:
    """A finished checkpoint: not a save (or deletion) in progress, which carries a `.tmp` name, and with its DCP
    metadata and trainer state. A job names its checkpoints step-<N>; a converted one may have any name."""
    return not path.name.endswith(".tmp") and (path / ".metadata").is_file() and (path / TRAINER_STATE).is_file()


def step_dirs(directory: Path) -> list[Path]:
    """The `step-<N>` directories of a `checkpoints/` directory, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def newest_complete(directory: Path) -> Path | None:
    """The newest complete `step-<N>` of a `checkpoints/` directory (not verified against its manifest)."""
    return next((p for p in step_dirs(directory) if is_complete(p)), None)


def check_seedable(job_dir: Path) -> None:
    """Refuse a seed checkpoint for a job that has a checkpoint already, or under torchrun (before anything is
    written)."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("a seed checkpoint is written by one process: run it without torchrun")
    latest = newest_complete(Path(job_dir) / "checkpoints")
    if latest is not None:
        raise ValueError(f"{job_dir} already has a checkpoint ({latest.name}): a seed checkpoint only starts a new "
                         f"job")
