"""Progress bars of the long commands: on stderr with a rate and, where the total is known, an ETA; off when
stderr is not a terminal (logs, SLURM, pipes), so batch jobs get only their summary lines."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Iterator


def progress_bar(desc: str, iterable=None, total: int | float | None = None, unit: str = "it",
                 disable: bool | None = None, **kwargs):
    """A tqdm bar (over `iterable`, if given); `disable=None` turns it off when stderr is not a terminal, True
    always."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=disable, mininterval=0.5,
                dynamic_ncols=True, **kwargs)


@contextmanager
def stages(desc: str, names: Sequence[str]) -> Iterator:
    """A bar over the named stages of a command; `next(bar)` (the yielded callable) starts the next one."""
    bar = progress_bar(desc, total=len(names), unit="stage",
                       bar_format="{desc}: {n_fmt}/{total_fmt} {postfix} [{elapsed}<{remaining}]")
    position = iter(range(len(names)))

    def advance() -> None:
        i = next(position)
        if i:
            bar.update(1)
        bar.set_postfix_str(names[i])

    try:
        yield advance
        bar.update(bar.total - bar.n)
    finally:
        bar.close()
