"""A job's two record files, read without torch (for `maester status`, `report`, `plot` and sweeps), and their
schema:

- `metrics.jsonl`: one row per logged step, a table (`{r["step"]: r["loss"] for r in rows}` works on every row);
- `events.jsonl`: what happened, one line each: checkpoints saved, failed or set aside, loads, the watch after a
  load, stops, restarts, the ranks' hosts, failed evaluations.

Both are appended a whole line at a time, line-buffered; a line without its newline (a process killed mid-write)
is not a record yet: readers skip it, and the next writer drops it. Jobs written before events had a file of their
own hold their event lines in metrics.jsonl: `read_metrics` skips them and `read_events` reads them first.

`STEP_FIELDS`, `STEP_PREFIXES` and `EVENT_FIELDS` are the schema (docs/observability.md shows `schema_markdown()`);
with `_MAESTER_CHECK_RECORDS=1` (the test suite sets it) every writer refuses a line that does not fit it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

METRICS, EVENTS = "metrics.jsonl", "events.jsonl"
CHECK_RECORDS = "_MAESTER_CHECK_RECORDS"

STEP_FIELDS = {
    "step": "the step (an integer; every other value is a number, or null where it is not finite or not known)",
    "loss": "the step's training loss: summed token losses over the step's label tokens",
    "lr": "`optimizer.lr` times the schedule's multiplier",
    "grad_norm": "the gradient's global norm, before clipping",
    "grad_scale": "fp16: the loss scale",
    "tokens_per_second": "tokens trained per second over the window since the last logged step, all ranks",
    "step_seconds": "mean seconds per step over the window (evaluation and checkpoint time left out)",
    "mfu": "nominal model FLOPs utilisation (null where the device has no peak-FLOPs figure)",
    "data_loading_seconds": "seconds the loop waited for batches in the window",
    "data_loading_share": "that wait as a share of the window",
    "peak_memory_gib": "peak allocated accelerator memory (on the CPU, the process's peak resident set)",
    "tokens_seen": "tokens trained since the run's first step, all ranks",
    "skipped_steps": "`training.nonfinite = \"skip\"`: steps skipped so far",
    "label_tokens_per_step": "label tokens per step over the window, all ranks",
    "padding_efficiency": "tokens that are not padding, as a share",
    "documents_per_step": "packed documents (conversations) per step",
    "document_tokens_mean": "their mean length in tokens",
    "document_tokens_max": "the longest",
    "val_loss": "the held-out loss over all validation data (`logging.eval_interval` steps)",
    "val_perplexity": "its perplexity",
}
STEP_PREFIXES = {
    "lr/": "the learning rate of each named parameter group (`lr/decay`, `lr/muon`, ...)",
    "data/": "per source: `data/<source>/tokens`, `documents`, `skipped`, `epochs`, ...",
    "val/": "per `data.validation` source: `val/<name>/loss`, `val/<name>/perplexity`",
    "eval/": "downstream tasks: `eval/<task>/<metric>`, and `eval/seconds` they took",
    "moe/": "per MoE layer: `moe/layers.<i>/load_min`, `load_max`, `load_entropy`, `balance_loss`, `z_loss`",
}
_SLURM = {"slurm_job_id": "the SLURM job", "slurm_restart_count": "SLURM's requeue count"}
EVENT_FIELDS: dict[str, tuple[dict[str, str], dict[str, str]]] = {  # kind: (required fields, optional fields)
    "hosts": ({"hosts": "each host with its ranks, `{\"node1\": [0, 1], ...}`"}, {"slurm_job_id": _SLURM["slurm_job_id"]}),
    "load": ({"checkpoint": "the checkpoint or directory loaded", "mode": "`continue` (a resume), a "
              "`checkpoint.load_mode`, `seed` (the job's seed checkpoint) or `hf` (Hugging Face weights)"}, {}),
    "checkpoint": ({"checkpoint": "its directory name", "background": "written by a background thread",
                    "checkpoint_blocked_seconds": "seconds the loop waited"},
                   {"checkpoint_write_seconds": "seconds the write took"}),
    "checkpoint_failed": ({"checkpoint": "its directory name", "background": "written by a background thread",
                           "checkpoint_blocked_seconds": "seconds the loop waited", "error": "why"},
                          {"checkpoint_write_seconds": "seconds the write took"}),
    "checkpoint_damaged": ({"checkpoint": "the checkpoint set aside at resume", "moved_to": "its new name",
                            "problems": "what its check found"}, {}),
    "watch": ({"checkpoint": "the checkpoint loaded", "verdict": "`passed` after the watched steps, or `failed`"},
              {"loss": "the failed step's loss", "grad_norm": "its gradient norm",
               "set_aside": "checkpoints saved since the load, set aside"}),
    "stop": ({"reason": "why (SIGTERM, the stop file, ...)", "checkpoint": "the checkpoint it saved",
              "time": "when"}, _SLURM),
    "restart": ({"restart": "its number", "max_restarts": "`slurm.max_restarts`", "failed_job": "the job that failed",
                 "exit_code": "its exit code", "cause": "the cause read from its logs", "job_id": "the job that "
                 "runs next"}, {"rank": "the rank that failed first", "host": "its host", "how": "`requeued`, "
                 "`requeued by SLURM` or `resubmitted`"}),
    "eval_failed": ({"task": "the lm-eval task", "error": "why"}, {}),
}


def check_row(record: dict) -> list[str]:
    """What in a metrics.jsonl row does not fit `STEP_FIELDS` and `STEP_PREFIXES` (empty: it fits)."""
    problems = []
    if not isinstance(record.get("step"), int) or isinstance(record.get("step"), bool) or "event" in record:
        problems.append("a row needs an integer 'step' and no 'event'")
    for key, value in record.items():
        if key == "step":
            continue
        if key not in STEP_FIELDS and not key.startswith(tuple(STEP_PREFIXES)):
            problems.append(f"{key!r} is not a documented field")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            problems.append(f"{key} = {value!r} is not a number or null")
    return problems


def check_event(record: dict) -> list[str]:
    """What in an events.jsonl line does not fit `EVENT_FIELDS` (empty: it fits)."""
    kind = record.get("event")
    if kind not in EVENT_FIELDS:
        return [f"event {kind!r} is not one of {', '.join(EVENT_FIELDS)}"]
    required, optional = EVENT_FIELDS[kind]
    problems = [] if isinstance(record.get("step"), int) else ["an event needs an integer 'step'"]
    problems += [f"{kind}: {key!r} is missing" for key in required if key not in record]
    problems += [f"{kind}: {key!r} is not a documented field" for key in record
                 if key not in required and key not in optional and key not in ("event", "step")]
    return problems


def checked(record: dict, check) -> dict:
    """`record`, refused (a ValueError) when `_MAESTER_CHECK_RECORDS=1` and it does not fit the schema."""
    if os.environ.get(CHECK_RECORDS) == "1":
        problems = check(record)
        if problems:
            raise ValueError(f"a record that does not fit its schema ({'; '.join(problems)}): {record}")
    return record


def append_event(job_dir: Path, record: dict) -> None:
    """One line appended to the job's events.jsonl, for writers outside a training run (a SLURM job's end)."""
    line = json.dumps(checked(record, check_event)) + "\n"
    with open(Path(job_dir) / EVENTS, "a") as f:
        f.write(line)


def read_metrics(path: Path) -> list[dict]:
    """The logged steps of a job (its metrics.jsonl), in step order; a step logged again after a restart overrides
    the earlier line. Event lines of older jobs are skipped; their evaluation lines are merged into the step's row."""
    by_step: dict[int, dict] = {}
    for record in _records(path):
        if "event" in record:
            continue
        step = record["step"]
        by_step[step] = record if "loss" in record else {**by_step.get(step, {}), **record}
    return [by_step[s] for s in sorted(by_step)]


def read_events(job_dir: Path) -> list[dict]:
    """The events of a job, in the order they were written: those an older job kept in metrics.jsonl, then
    events.jsonl's."""
    job_dir = Path(job_dir)
    old = [r for r in _records(job_dir / METRICS) if "event" in r] if (job_dir / METRICS).is_file() else []
    return old + (list(_records(job_dir / EVENTS)) if (job_dir / EVENTS).is_file() else [])


def schema_markdown() -> str:
    """The schema as docs/observability.md shows it."""
    lines = ["| metrics.jsonl field | what |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in STEP_FIELDS.items()]
    lines += [f"| `{k}...` | {v} |" for k, v in STEP_PREFIXES.items()]
    lines += ["", "| events.jsonl `event` | fields beside `event` and `step` (optional in italics) |", "|---|---|"]
    for kind, (required, optional) in EVENT_FIELDS.items():
        fields = [f"`{k}`: {v}" for k, v in required.items()] + [f"*`{k}`*: {v}" for k, v in optional.items()]
        lines.append(f"| `{kind}` | {'; '.join(fields)} |")
    return "\n".join(lines) + "\n"


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
