"""Reading a job's metrics.jsonl, without torch (for `maester status`, `report`, `plot` and sweeps): the logged
steps, and the event lines between them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """The logged steps of a job, in step order; a step logged again after a restart overrides the earlier line."""
    by_step: dict[int, dict] = {}
    for record in _records(path):
        if "event" in record:
            continue
        # A train line starts its step afresh (a restart logs the steps after its checkpoint again, dropping what
        # the earlier attempt logged there); the eval line that follows it merges in.
        step = record["step"]
        by_step[step] = record if "loss" in record else {**by_step.get(step, {}), **record}
    return [by_step[s] for s in sorted(by_step)]


def read_events(path: Path) -> list[dict]:
    """The event lines ({"event": ..., "step": ...}), in the order they were written: a damaged checkpoint moved
    aside, a stop on request (`stop`), each checkpoint save (`checkpoint`, `checkpoint_failed`)."""
    return [record for record in _records(path) if "event" in record]


def _records(path: Path) -> Iterator[dict]:
    lines = path.read_text().split("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # a running job may be writing its last line right now
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{lineno}: not a metrics record (no integer 'step')")
        yield record
