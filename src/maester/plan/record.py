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
    job has no plan.json."""
    path = Path(job_dir) / PLAN_FILE
    if not path.is_file():
        return []
    plan = read_json_object(path)
    if "not_made" in plan:
        return [("plan", f"not made: {plan['not_made']}")]
    items = []
    predicted = plan.get("peak_gib")
    if predicted is not None:
        text = f"{predicted:.2f} GiB per rank predicted ({plan['verdict']['kind'].replace('_', ' ')} on " \
               f"{plan['gpus']} x {plan['gpu']})"
        if peak_memory_gib is not None:
            text += f"; measured {peak_memory_gib:.2f} GiB, {peak_memory_gib / predicted:.2f}x the prediction"
        items.append(("planned memory", text))
    throughput = plan.get("throughput") or {}
    if throughput.get("tokens_per_second"):
        tps = throughput["tokens_per_second"]
        text = f"{tps:,.0f} tokens/s predicted at {100 * throughput['mfu']:.0f}% MFU"
        if tokens_per_second is not None:
            text += f"; measured {tokens_per_second:,.0f}, {tokens_per_second / tps:.2f}x the prediction"
        items.append(("planned tokens/s", text))
    return items
