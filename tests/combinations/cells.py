"""One cell of the combination matrix, run as a user's job would run it, each phase in fresh processes:

1. **kill**: `maester train` trains a tiny model with the cell's settings for 6 steps, saving at step 3; at step 6
   it stands still (the `hang` fault point, before step 6 is logged or saved), and once step-3 is complete (the
   `latest` link names it) every rank is SIGKILLed. Its logged steps 1-5 are the uninterrupted run.
2. **resume**: new processes resume the job from step-3 (or, for load `continue`, a new job continues it with
   `checkpoint.init_from` and `load_mode = "continue"`); steps 4 and 5 must log the same loss and gradient norm,
   bit for bit.
3. **export** (`export.py`, one process for several cells): `maester convert to-hf` of step-3, then `maester
   generate` of the export; the logits of the export under `transformers` must equal those of maester's model loaded
   from step-3, the state that step 2 showed to be the live one.

A cell the table refuses (`maester.combinations.REFUSALS`) must be refused before step 1, with the table's message.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.processes import Ranks, Zygote

STEPS, SAVED, COMPARED = 6, 3, (4, 5)
PHASE_TIMEOUT = 900.0  # seconds; a compile on a machine five times oversubscribed takes minutes

WORLD = {"one": 1, "fsdp": 2, "hsdp": 4, "ddp": 2, "tp": 2, "pp": 2, "cp": 2, "ep": 2, "tp_fsdp": 4}
DATA_PARALLEL = {"one": 1, "fsdp": 2, "hsdp": 4, "ddp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 2, "tp_fsdp": 2}
# micro-batches per step and rank: two where accumulating is a path of its own (gradient sync or reduce-scatter once
# per step; the pipeline's schedule), one where each forward costs most (DTensor dispatch under TP, CP's gathers)
ACCUMULATION = {"one": 2, "fsdp": 2, "hsdp": 1, "ddp": 2, "tp": 1, "pp": 2, "cp": 1, "ep": 1, "tp_fsdp": 1}
GLOBAL_BATCH = 4  # sequences
LAYOUT = {
    "one": {}, "fsdp": {"parallel.dp_shard": 2}, "hsdp": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2},
    "ddp": {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, "tp": {"parallel.tp": 2, "parallel.dp_shard": 1},
    "pp": {"parallel.pp": 2, "parallel.dp_shard": 1}, "cp": {"parallel.cp": 2, "parallel.dp_shard": 1},
    "ep": {"parallel.dp_shard": 2, "parallel.ep": 2}, "tp_fsdp": {"parallel.tp": 2, "parallel.dp_shard": 2},
}
PRECISION = {
    "fp32": {"training.precision": "fp32"}, "bf16": {"training.precision": "auto"},
    "bf16-pure": {"training.precision": "bf16-pure"}, "fp16": {"training.precision": "fp16"},
    **{f"float8-{recipe}": {"training.precision": "auto", "training.float8.enabled": "true",
                            "training.float8.emulate": "true", "training.float8.recipe": recipe}
       for recipe in ("tensorwise", "rowwise")},
}
OPTIMIZER = {"adamw": {"optimizer.name": "adamw"}, "muon": {"optimizer.name": "muon"},
             "torch": {"optimizer.name": "RMSprop"}}
MUP = {"off": {}, "on": {"mup.enabled": "true", "mup.base_width": 32}}
COMPILE = {"off": {}, "on": {"parallel.compile": "true"}}
AC = {"none": {}, "selective": {"parallel.activation_checkpointing": "selective-op"},
      "full": {"parallel.activation_checkpointing": "full"}}
CHECKPOINT = {"sync": {"checkpoint.async_mode": "off"}, "async": {"checkpoint.async_mode": "auto"},
              "pinned": {"checkpoint.async_mode": "pinned"}}
FAMILY = {"dense": {"model.name": "llama"},
          # two layers, one sliding and one global, instead of the tiny flavor's six
          "sliding": {"model.name": "gemma3", "model.overrides": json.dumps({"n_layers": 2,
                                                                            "sliding_window_pattern": 2})},
          "moe": {"model.name": "olmoe"}}


@dataclass
class Files:
    """What the cells read, made once per session (`conftest.py`): data of each kind, and per model family a
    seed checkpoint (model_only) and its Hugging Face export (hf)."""

    root: Path
    data: dict[str, dict[str, str]]
    seeds: dict[str, Path] = field(default_factory=dict)
    hf: dict[str, Path] = field(default_factory=dict)


@dataclass
class Cell:
    values: dict[str, str]
    index: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each phase that ran (its processes and theirs, compilers included)."""

    @property
    def name(self) -> str:
        return f"c{self.index:03d}-" + "-".join(self.values[k] for k in ("layout", "precision", "checkpoint"))

    @property
    def world(self) -> int:
        return WORLD[self.values["layout"]]

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items())

    def settings(self, files: Files) -> dict[str, object]:
        """The config overrides of the cell's run (without its load)."""
        v = self.values
        out: dict[str, object] = {
            "model.flavor": "tiny", "data.seq_len": 32, "data.num_workers": 0, "training.steps": STEPS,
            "training.global_batch_size": GLOBAL_BATCH, "training.device": "cpu",
            "training.micro_batch_size": GLOBAL_BATCH // (DATA_PARALLEL[v["layout"]] * ACCUMULATION[v["layout"]]),
            "training.cpu_threads": 1, "optimizer.lr": "3e-3", "schedule.name": "cosine",
            "schedule.warmup_steps": 2, "checkpoint.interval": SAVED, "checkpoint.keep_last": 2,
            "logging.interval": 1,
        }
        for table, key in ((LAYOUT, "layout"), (PRECISION, "precision"), (OPTIMIZER, "optimizer"), (MUP, "mup"),
                           (COMPILE, "compile"), (AC, "ac"), (CHECKPOINT, "checkpoint"), (FAMILY, "family")):
            out.update(table[v[key]])
        out.update(files.data[v["data"]])
        load = v["load"]
        if load == "model_only":
            out.update({"checkpoint.init_from": str(files.seeds[v["family"]]), "checkpoint.load_mode": "model_only"})
        elif load == "hf":
            out.update({"checkpoint.init_from": f"hf:{files.hf[v['family']]}", "checkpoint.load_mode": "model_only"})
        return out

    def argv(self, files: Files, name: str, **extra) -> list[str]:
        settings = {**self.settings(files), "job.name": name, "job.dump_dir": str(files.root / "jobs"), **extra}
        return ["train", str(files.root / "base.toml"), *[f"--{k}={v}" for k, v in settings.items()]]


class CellFailed(AssertionError):
    pass


def _env(**extra: str) -> dict[str, str]:
    return {"_MAESTER_GPU_DEFAULTS": "1", **extra}


def _wait_standing_still(ranks: Ranks, job: Path, timeout: float) -> None:
    """Until every rank stands still at step STEPS and step-SAVED is the complete `latest`; raises if a rank ends."""
    latest = job / "checkpoints" / "latest"
    marker = f"standing still at step {STEPS}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        statuses = ranks.statuses()
        if any(s is not None for s in statuses):
            ranks.kill()
            raise CellFailed(f"the run ended before step {STEPS} ({statuses}):\n{ranks.log_tail()}")
        if latest.is_symlink() and os.readlink(latest) == f"step-{SAVED}" and \
                all(log.exists() and marker in log.read_text() for log in ranks.logs):
            return
        time.sleep(0.1)
    ranks.kill()
    raise CellFailed(f"no complete step-{SAVED} with every rank at step {STEPS} within {timeout} s:\n"
                     f"{ranks.log_tail()}")


def _steps(job: Path) -> dict[int, tuple[float, float]]:
    from maester.train.metrics_file import read_metrics

    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(job / "metrics.jsonl") if "loss" in r}


def run_refused(cell: Cell, files: Files, zygote: Zygote, message: str, **extra) -> None:
    """The cell's run (with the settings `extra` too) must end before its first step, rank 0 with exit code 2
    saying `message`, and leave no job. The other ranks refuse it too, or, where the refusal comes once the process
    group is up and a slow rank was still joining it when its peers left, end with a collective error (exit 6)."""
    from maester.exit_codes import BAD_INPUT, COLLECTIVE

    logs = files.root / "logs"
    ranks = Ranks(zygote, cell.world, cell.argv(files, cell.name, **extra), logs, _env(), cell.name)
    statuses = ranks.wait(PHASE_TIMEOUT, every=True)
    job = files.root / "jobs" / cell.name
    tails = ranks.log_tail()
    if statuses[0] != BAD_INPUT or message not in ranks.logs[0].read_text() or \
            any(s not in (BAD_INPUT, COLLECTIVE) for s in statuses):
        raise CellFailed(f"expected a refusal (exit 2) saying {message!r}, got {statuses}:\n{tails}")
    if job.exists():  # a refusal changes no file
        raise CellFailed(f"refused, but left {job}: {sorted(p.name for p in job.iterdir())}")


def run_cell(cell: Cell, files: Files, zygote: Zygote) -> Path:
    """Phases 1 and 2; returns the checkpoint to export."""
    logs = files.root / "logs"
    job = files.root / "jobs" / cell.name
    never = files.root / "never"
    start = zygote.cpu_seconds
    killed = Ranks(zygote, cell.world, cell.argv(files, cell.name), logs,
                   _env(_MAESTER_FAULT=f"hang:{STEPS}", _MAESTER_HANG_UNTIL=str(never),
                        _MAESTER_HANG_SECONDS=str(int(PHASE_TIMEOUT))), f"{cell.name}-kill")
    _wait_standing_still(killed, job, PHASE_TIMEOUT)
    killed.kill()
    if killed.wait(60, every=True) != [-9] * cell.world:
        raise CellFailed(f"the ranks did not end by SIGKILL: {killed.statuses()}")
    cell.cpu["kill"] = zygote.cpu_seconds - start
    expected = _steps(job)
    if sorted(expected) != list(range(1, STEPS)):
        raise CellFailed(f"the killed run logged steps {sorted(expected)}")
    checkpoint = job / "checkpoints" / f"step-{SAVED}"

    if cell.values["load"] == "continue":
        resumed_job = files.root / "jobs" / f"{cell.name}-continued"
        argv = cell.argv(files, resumed_job.name, **{"checkpoint.init_from": str(checkpoint),
                                                    "checkpoint.load_mode": "continue"})
    else:
        resumed_job, argv = job, ["train", str(job)]
    start = zygote.cpu_seconds
    resumed = Ranks(zygote, cell.world, argv, logs, _env(), f"{cell.name}-resume")
    statuses = resumed.wait(PHASE_TIMEOUT)
    cell.cpu["resume"] = zygote.cpu_seconds - start
    if statuses != [0] * cell.world:
        raise CellFailed(f"the resume from step-{SAVED} failed ({resumed.statuses()}):\n{resumed.log_tail()}")
    got = _steps(resumed_job)
    for step in COMPARED:
        if got.get(step) != expected[step]:
            raise CellFailed(f"step {step} after the resume logged (loss, grad_norm) {got.get(step)}; the "
                             f"uninterrupted run {expected[step]}")
    return checkpoint


def clean(cell: Cell, files: Files) -> None:
    """Remove the cell's jobs but the checkpoint the export reads (they add up over hundreds of cells)."""
    for job in (files.root / "jobs").glob(f"{cell.name}*"):
        shutil.rmtree(job / "logs", ignore_errors=True)
