"""A duration as a person reads it: seconds, minutes, hours or days, in the largest unit that still counts to 2
or more, so that `maester plan`'s step times and the reports' ages and remaining times read alike."""

from __future__ import annotations

UNITS = ((120, 1, "s"), (2 * 3600, 60, "min"), (2 * 86400, 3600, "h"))


def format_duration(seconds: float, digits: int = 1) -> str:
    """`seconds` (a negative one, from clocks that disagree, as 0) with `digits` after the point in its unit."""
    seconds = max(seconds, 0.0)
    for below, size, unit in UNITS:
        if seconds < below:
            return f"{seconds / size:.{digits}f} {unit}"
    return f"{seconds / 86400:.{digits}f} days"
