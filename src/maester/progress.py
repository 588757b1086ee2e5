"""Progress bars of the long commands: on stderr with a rate and, where the total is known, an ETA; off when
stderr is not a terminal (logs, SLURM, pipes), so batch jobs get only their summary lines, except where a command
can run for minutes with nothing else to say (`lines_every`): then a plain line now and then."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from typing import Iterator


def stderr_line(text: str) -> None:
    """`text` and its newline on stderr in one write: the ranks of a job share one stderr, and `print` writes the
    newline apart, so two ranks' lines could run together on one line."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def progress_bar(desc: str, iterable=None, total: int | float | None = None, unit: str = "it",
                 disable: bool | None = None, lines_every: float | None = None, **kwargs):
    """A tqdm bar (over `iterable`, if given); `disable=None` turns it off when stderr is not a terminal, True
    always. `lines_every` (seconds, with an iterable and a total): where the bar is off because stderr is not a
    terminal, a line at the start, then every so many seconds, and at the end (`progress_lines`)."""
    from tqdm import tqdm

    if lines_every is not None and disable is None and not sys.stderr.isatty():
        return progress_lines(desc, iterable, int(total), unit, lines_every)
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=disable, mininterval=0.5,
                dynamic_ncols=True, **kwargs)


def progress_lines(desc: str, iterable: Iterable, total: int, unit: str, every: float,
                   clock=time.monotonic) -> Iterator:
    """The items of `iterable`, with a line on stderr before the first, after the last, and after any item that
    ends at least `every` seconds after the line before: how many of `total` are done, in how long, and an ETA."""
    start = last = clock()
    unit = unit.strip()
    print(f"{desc}: 0 of {total} {unit}", file=sys.stderr, flush=True)
    done = 0
    for item in iterable:
        yield item
        done += 1
        now = clock()
        if now - last >= every or done == total:
            last = now
            left = (now - start) / done * (total - done)
            print(f"{desc}: {done} of {total} {unit} in {now - start:.0f} s"
                  + (f", about {left:.0f} s left" if done < total else ""), file=sys.stderr, flush=True)


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
