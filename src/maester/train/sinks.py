"""The metric sinks beside metrics.jsonl and the console: TensorBoard event files and Weights & Biases runs.

Each sink gets every finite number of a record under the record's own key (`loss`, `lr/decay`,
`data/<source>/<count>`, `val_loss`, ...), at the record's `step`. Both packages are optional extras, imported only
when their sink is enabled.

Restarts: a job resumes from its last checkpoint, so the steps an earlier attempt logged after that checkpoint come
again. TensorBoard purges them from the event files (`purge_step`). The W&B run id is kept in the job directory and
the same run is resumed; its history continues at the step after the checkpoint, or online after the last step the
W&B server already has (W&B cannot take a step twice).
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import string
import sys
from pathlib import Path
from typing import Any, Protocol

from maester.files import write_atomically

log = logging.getLogger("maester")

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_RUN_ID_FILE = "run-id"
"""Under `<job dir>/wandb/`: the W&B run id of the job, written at its first start and read at every later one."""

_RUN_ID = re.compile(r"[A-Za-z0-9_-]+")


class SinkError(ValueError):
    """A sink that cannot be opened; the message names the config key."""


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float | int]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float | int]:
    """The finite numbers of a record, by key, without `step` (None, NaN, inf, bools and strings are left out)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def open_sinks(cfg, job_dir: Path, resume_step: int) -> list[Sink]:
    """The sinks `cfg.logging` enables, for a run in `job_dir` that starts after step `resume_step`."""
    sinks: list[Sink] = []
    try:
        if cfg.logging.tensorboard.enabled:
            sinks.append(TensorBoardSink(job_dir / TENSORBOARD_DIR, purge_step=resume_step + 1))
        if cfg.logging.wandb.enabled:
            sinks.append(WandbSink(cfg, job_dir, resume_step))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


class TensorBoardSink:
    """Scalars in TensorBoard event files (float32, as TensorBoard stores them), flushed at every write so that a
    running job can be watched and a crash loses nothing logged."""

    def __init__(self, log_dir: Path, purge_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise SinkError(f"logging.tensorboard.enabled is true, but TensorBoard cannot be imported ({e}): "
                            f"pip install 'maester[tensorboard]'") from None
        # TensorBoard's readers discard the events of this log dir at steps >= purge_step: those an earlier attempt
        # wrote after the checkpoint this run resumes from (with no checkpoint yet, all of them).
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, values: dict[str, float | int]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per job: created at the first start, resumed (same id) at every restart or requeue."""

    def __init__(self, cfg, job_dir: Path, resume_step: int):
        wb = cfg.logging.wandb
        # wandb prints to our console before its settings apply (e.g. at login) unless this is set.
        os.environ.setdefault("WANDB_SILENT", "true")
        if wb.mode == "offline":
            # wandb reports its own errors and usage to W&B unless told not to; offline means no network at all.
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        try:
            import wandb
        except ImportError as e:
            raise SinkError(f"logging.wandb.enabled is true, but wandb cannot be imported ({e}): "
                            f"pip install 'maester[wandb]'") from None
        run_id = wandb_run_id(job_dir)
        try:
            self._run: Any = wandb.init(
                dir=str(job_dir), id=run_id, resume="allow",
                project=wb.project or os.environ.get("WANDB_PROJECT") or "maester",
                entity=wb.entity or os.environ.get("WANDB_ENTITY") or None, name=wb.name or cfg.job.name, group=wb.group, tags=wb.tags or None, mode=wb.mode,
                config=cfg.model_dump(mode="json"), allow_val_change=True,  # a restart may change the config
                # silent: no banner or hints on our console; console "off": our stdout and stderr stay untouched.
                settings=wandb.Settings(silent=True, console="off", init_timeout=wb.init_timeout),
            )
        except wandb.Error as e:
            hint = " (logging.wandb.mode=offline logs without a network)" if wb.mode == "online" else ""
            raise SinkError(f"logging.wandb: could not start W&B run {run_id} in {wb.mode} mode: {e}{hint}") from None
        # W&B ignores steps below the run's current one; a resumed online run may already have the steps an earlier
        # attempt logged after its last checkpoint, and it keeps those.
        self._first_step = self._run.step
        if self._first_step > resume_step + 1:
            log.warning("W&B run %s already has steps up to %d from an earlier attempt: it keeps them, and this "
                        "attempt logs to it from step %d", run_id, self._first_step - 1, self._first_step)
        if wb.mode == "online":
            log.info("W&B run %s: %s", run_id, self._run.url)
        else:
            log.info("W&B offline run %s: upload it with `wandb sync %s`", run_id, self._run.settings.sync_dir)

    def log(self, step: int, values: dict[str, float | int]) -> None:
        if step >= self._first_step:
            self._run.log(values, step=step)

    def close(self) -> None:
        # The trainer closes its writer in a `finally`: an exception on its way out marks the run failed.
        self._run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)


def wandb_run_id(job_dir: Path) -> str:
    """The job's W&B run id from `<job dir>/wandb/run-id`; on the first start a new one (8 random lowercase letters
    and digits, as W&B makes them), written there atomically."""
    path = job_dir / WANDB_DIR / WANDB_RUN_ID_FILE
    if path.exists():
        run_id = path.read_text().strip()
        if not _RUN_ID.fullmatch(run_id):
            raise SinkError(f"{path}: {run_id!r} is not a W&B run id (letters, digits, '-' and '_'); delete the "
                            f"file to start a new run")
        return run_id
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, run_id + "\n")
    return run_id
