"""A job's checkpoint directories by name, without torch (for `maester status`): `step-<N>`, which of them are
complete, the newest."""

from __future__ import annotations

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
