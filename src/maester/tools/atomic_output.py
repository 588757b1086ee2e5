"""Output files written under temporary names beside their final ones, renamed into place only when all are
complete: a run that fails leaves nothing under a final name."""

from __future__ import annotations

import os
from pathlib import Path

from maester.files import temp_beside


class AtomicOutputs:
    """Use as a context manager: a clean exit renames every temporary file onto its final name, an exception
    removes them all."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Path, Path]] = []

    def __enter__(self) -> "AtomicOutputs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    def temp_for(self, final: Path) -> Path:
        """A new empty temporary file in `final`'s directory, to be renamed to `final` on commit."""
        name = temp_beside(Path(final))
        self._pairs.append((name, Path(final)))
        return name

    def commit(self) -> None:
        try:
            for tmp, _ in self._pairs:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            for tmp, final in self._pairs:
                os.replace(tmp, final)
        except BaseException:
            self.discard()
            raise
        self._pairs.clear()

    def discard(self) -> None:
        for tmp, _ in self._pairs:
            tmp.unlink(missing_ok=True)
        self._pairs.clear()
