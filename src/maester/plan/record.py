"""plan.json in a job directory: the plan `maester submit` made before submitting (`write_plan`), and its prediction
beside what the job measured (`compared_with_plan`, for `maester report`)."""

from __future__ import annotations

import json
from pathlib import Path

from maester.files import read_json_object, write_atomically

PLAN_FILE = "plan.json"


def write_plan(job_dir: Path, plan: dict) -> None:
    write_atomically(Path(job_dir) / PLAN_FILE, json.dumps(plan, indent=2) + "\n")


def compared_with_plan(job_dir: Path, peak_memory_gib: float | None,
                       tokens_per_second: float | None) -> list[tuple[str, str]]:
    """Report lines (label, text): the predicted peak memory per rank and tokens/s beside the measured ones (the
    measured peak is torch.cuda.max_memory_allocated on GPUs, the process's peak RSS on the CPU). None where the
    job has no plan.json; a plan.json that cannot be read is left out, and the line says why (the report of the
    job's own measurements is drawn all the same)."""
    path = Path(job_dir) / PLAN_FILE
    if not path.is_file():
        return []
    try:
        plan = read_json_object(path)
        if "not_made" in plan:
            return [("plan", f"not made: {plan['not_made']}")]
        return _predictions(plan, peak_memory_gib, tokens_per_second)
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
        reason = f"no {e}" if isinstance(e, KeyError) else str(e).removeprefix(f"{path}: ")
        return [("plan", f"left out: {path} cannot be read ({reason})")]


def _predictions(plan: dict, peak_memory_gib: float | None, tokens_per_second: float | None) -> list[tuple[str, str]]:
    items = []
    predicted = _number(plan, "peak_gib")
    if predicted is not None:
        text = f"{predicted:.2f} GiB per rank predicted ({plan['verdict']['kind'].replace('_', ' ')} on " \
               f"{plan['gpus']} x {plan['gpu']})"
        if peak_memory_gib is not None:
            text += f"; measured {peak_memory_gib:.2f} GiB, {peak_memory_gib / predicted:.2f}x the prediction"
        items.append(("planned memory", text))
    throughput = plan.get("throughput") or {}
    if throughput.get("tokens_per_second"):
        tps = _number(throughput, "tokens_per_second")
        text = f"{tps:,.0f} tokens/s predicted at {100 * _number(throughput, 'mfu'):.0f}% MFU"
        if tokens_per_second is not None:
            text += f"; measured {tokens_per_second:,.0f}, {tokens_per_second / tps:.2f}x the prediction"
        items.append(("planned tokens/s", text))
    return items


def _number(values: dict, key: str) -> float | None:
    value = values.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{key} is {value!r}, not a number")
    return value
