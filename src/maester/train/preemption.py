"""Stopping a run cleanly before its end (walltime warnings, preemption), and the marker of a finished run.

A stop request reaches the trainer in one of two ways:

- the signal SIGTERM or SIGUSR1 to a training process (SLURM's preemption and time limit, torchrun passing its
  own SIGTERM on to its workers, or `kill`): the handler only sets a flag;
- the file `<job_dir>/stop-requested` appearing. The SLURM script's trap touches it when the warning of
  `--signal=B:USR1@<seconds>` reaches the batch shell, since signalling torchrun itself would kill it.

The trainer looks once per optimizer step and all ranks agree (`StopRequests.agree`, one step later with several
processes), so a request that reaches one rank stops every rank after the same step. It then saves a checkpoint of that step, and rank 0 removes the
stop file and writes `requeue-requested`; every process exits with `REQUEUE_EXIT_CODE`. (torchrun, seeing the
first of them exit with an error code, ends those still shutting down with SIGTERM and exits with 1 itself: the
file, not an exit code, is what tells the SLURM script to requeue.)

The files of the job directory that the SLURM script reads or writes:

    stop-requested      touched to ask for a stop; removed by the trainer once it has stopped
    requeue-requested   rank 0, after the checkpoint of a stop: {"step", "reason", "time", "checkpoint"}
    COMPLETED           rank 0, after the last step and its checkpoint: {"step", "time", "checkpoint"}

A later `maester train` of a job whose COMPLETED step is at least `training.steps` has nothing to do and exits 0
at once (`completed_marker`); raising `training.steps` above it continues the run, which then removes the marker
until it ends again. This module imports torch only where it communicates, so that this check takes no time.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

from maester import exit_codes
from maester.files import write_atomically

log = logging.getLogger("maester")

STOP_FILE = "stop-requested"
REQUEUE_FILE = "requeue-requested"
COMPLETED_FILE = "COMPLETED"
REQUEUE_EXIT_CODE = exit_codes.REQUEUE
"""The exit code of every training process that stopped on a request after saving a checkpoint."""

# The reasons for a stop, by code; ranks agree on the highest code any of them saw (0: no request).
REASONS = (None, STOP_FILE, "SIGUSR1", "SIGTERM")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """Catches stop requests while training (signal handlers from `install` to `restore`) and makes all ranks agree
    on them."""

    def __init__(self, job_dir: Path, rank: int):
        self.job_dir, self.rank = Path(job_dir), rank
        self._signalled = 0  # the highest code of a signal received
        self._previous: dict[int, object] = {}
        self._pending = None  # (work, flag) of the all-reduce of the last step's requests

    def install(self) -> None:
        """Catch SIGTERM and SIGUSR1, remembering the handlers they had."""
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError as e:  # only the main thread may install handlers
                self.restore()
                raise ValueError(f"training must run in the main thread to catch {sig.name} for a clean stop: {e}") \
                    from e

    def restore(self) -> None:
        """Give SIGTERM and SIGUSR1 back the handlers they had before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = max(self._signalled, REASONS.index(signal.Signals(signum).name))

    def local_code(self) -> int:
        """This rank's request: a signal it received, or (rank 0 only: one metadata lookup per step on a shared
        filesystem, not one per rank) the stop file."""
        code = self._signalled
        if self.rank == 0 and (self.job_dir / STOP_FILE).exists():
            code = max(code, REASONS.index(STOP_FILE))
        return code

    def agree(self) -> str | None:
        """The reason to stop after this step, the same on every rank; None: go on. A collective: every rank calls
        it after every optimizer step.

        One process: this step's request. Several: each step's requests are all-reduced on the host (gloo; on GPUs
        the process group's CPU backend) in the background while the next step trains, and read after it, so every
        rank stops after the same step, one step after the request, and no step waits for the GPU or a network
        round trip (OLMo-core checks its cancel flag off the hot path too). `drain` ends the last all-reduce.
        """
        import numpy as np
        import torch
        import torch.distributed as dist

        code = self.local_code()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return REASONS[code]
        agreed = self._read_pending()
        if agreed == 0:
            flag = np.array([code], dtype=np.int32)  # read through numpy once the all-reduce is done
            self._pending = (dist.all_reduce(torch.from_numpy(flag), op=dist.ReduceOp.MAX, async_op=True), flag)
        return REASONS[agreed]

    def drain(self) -> None:
        """Wait for the last step's all-reduce (every rank issued it) before the process group is used otherwise."""
        self._read_pending()

    def _read_pending(self) -> int:
        if self._pending is None:
            return 0
        work, flag = self._pending
        self._pending = None
        work.wait()
        return int(flag[0])

    def acknowledge(self, step: int, reason: str, checkpoint: Path | None) -> None:
        """After the checkpoint of a stop: rank 0 removes the stop file and writes `requeue-requested`; every rank
        waits for it, so that no process exits (and makes torchrun end the others) before the file exists."""
        import torch.distributed as dist

        if self.rank == 0:
            (self.job_dir / STOP_FILE).unlink(missing_ok=True)
            write_marker(self.job_dir / REQUEUE_FILE, {"step": step, "reason": reason,
                                                       "checkpoint": checkpoint.name if checkpoint else None})
        if dist.is_initialized():
            dist.barrier()


def write_marker(path: Path, record: dict) -> None:
    """A small JSON file with the current UTC time added, replaced atomically."""
    record = {**record, "time": datetime.now(UTC).isoformat(timespec="seconds")}
    write_atomically(path, json.dumps(record, indent=2) + "\n")


def read_marker(path: Path) -> dict | None:
    """The JSON of a marker file with its `step`; None when there is none."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); remove it if the run it describes is unknown") from e
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError(f"{path}: no integer 'step' in {record!r}; remove it if the run it describes is unknown")
    return record


def completed_marker(job_dir: Path, steps: int) -> dict | None:
    """The COMPLETED marker of the job when it covers `steps` (training.steps): the run has nothing left to do."""
    record = read_marker(Path(job_dir) / COMPLETED_FILE)
    return record if record is not None and record["step"] >= steps else None


def mark_completed(job_dir: Path, step: int, checkpoint: Path | None) -> None:
    """Rank 0, at the end of training: write COMPLETED; a stop request that came too late to matter is dropped."""
    job_dir = Path(job_dir)
    write_marker(job_dir / COMPLETED_FILE, {"step": step, "checkpoint": checkpoint.name if checkpoint else None})
    (job_dir / STOP_FILE).unlink(missing_ok=True)


def clear_markers_of_earlier_runs(job_dir: Path, step: int, steps: int) -> None:
    """Rank 0, when a run is about to train: a requeue request was served by this start, and a COMPLETED marker
    below the raised `training.steps` no longer describes the job."""
    job_dir = Path(job_dir)
    (job_dir / REQUEUE_FILE).unlink(missing_ok=True)
    done = read_marker(job_dir / COMPLETED_FILE)
    if done is not None:
        log.info("%s says training completed at step %d; training.steps = %d: continuing from step %d",
                 job_dir / COMPLETED_FILE, done["step"], steps, step)
        (job_dir / COMPLETED_FILE).unlink()


def stop_event(step: int, reason: str, checkpoint: Path) -> dict:
    """The events.jsonl event of a stop on request, with the SLURM job and its restart count where there is one."""
    slurm = {"slurm_job_id": os.environ["SLURM_JOB_ID"],
             "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)} \
        if os.environ.get("SLURM_JOB_ID") else {}
    return {"event": "stop", "step": step, "reason": reason, "checkpoint": checkpoint.name,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **slurm}
