"""How the `maester data` commands report: a progress bar on stderr while they run, one summary line at the end."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Summary:
    """What a data command did. `line()` is the last line it prints on stdout."""

    command: str
    documents: int = 0
    tokens: int | None = None  # None: the command does not tokenize
    elapsed: float = 0.0
    skipped: Counter = field(default_factory=Counter)
    extra: dict[str, object] = field(default_factory=dict)  # printed after the counts, in order

    def line(self) -> str:
        parts = [f"documents={self.documents}"]
        if self.tokens is not None:
            rate = self.tokens / self.elapsed if self.elapsed > 0 else 0.0
            parts += [f"tokens={self.tokens}", f"tokens/s={rate:.0f}"]
        parts.append(f"elapsed={self.elapsed:.2f}s")
        total = sum(self.skipped.values())
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.skipped.items()))
        parts.append(f"skipped={total}" + (f" ({reasons})" if total else ""))
        parts += [f"{k}={v}" for k, v in self.extra.items()]
        return f"{self.command}: " + " ".join(parts)


class Progress:
    """A bar on stderr (off when stderr is not a terminal) that counts documents and tokens, with an ETA when the
    `total` of records is known, and the clock the summary's elapsed time comes from."""

    def __init__(self, command: str, summary: Summary, total: int | None = None):
        from maester.progress import progress_bar

        self.summary = summary
        self._start = time.perf_counter()
        self._bar = progress_bar(command, total=total, unit=" docs", unit_scale=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
        self.summary.elapsed = time.perf_counter() - self._start

    def update(self, documents: int, tokens: int | None = None) -> None:
        self.summary.documents += documents
        if tokens is not None:
            self.summary.tokens = (self.summary.tokens or 0) + tokens
            self._bar.set_postfix_str(f"{self.summary.tokens:,} tokens", refresh=False)
        self._bar.update(documents)
