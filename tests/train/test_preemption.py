"""Stopping on a walltime warning or preemption: a signal or the stop file makes every rank save the same step and
exit with REQUEUE_EXIT_CODE; a rerun resumes to the losses of an uninterrupted run; a COMPLETED job does nothing."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from maester.cli import main
from maester.config import load_config
from maester.train.metrics_file import read_events
from maester.train.metrics import read_metrics
from maester.train.preemption import (
    COMPLETED_FILE,
    REQUEUE_EXIT_CODE,
    REQUEUE_FILE,
    STOP_FILE,
    StopRequests,
    completed_marker,
)
from maester.train.trainer import Trainer
from tests.helpers import DEMO_CONFIG, clean_env, tiny_overrides

STEPS = 20
# Steps of some tens of milliseconds, so that a signal sent after step 2 arrives well before the last step.
RUN = {"training__steps": STEPS, "training__global_batch_size": 16, "training__micro_batch_size": 4,
       "checkpoint__interval": 0}


def train_straight(corpus: Path, root: Path) -> dict[int, float]:
    """The losses of the run trained without a stop, in this process."""
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "straight", **RUN), environ={})
    Trainer(cfg, cfg.job_dir).train()
    return losses(cfg.job_dir)


def losses(job_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(job_dir / "metrics.jsonl")}


@contextmanager
def started(args: list[str], cwd: Path) -> Iterator[subprocess.Popen]:
    """A Python command in the background, at a lower priority than this test, which watches it. The process and
    its descendants (torchrun starts its workers outside its process group) are killed if they are still there
    when the context closes (a test that failed)."""
    proc = subprocess.Popen(["nice", "-n", "5", sys.executable, *args], cwd=cwd, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        for pid in [*descendants(proc.pid), proc.pid]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.communicate(timeout=60)


def wait_for_step(proc: subprocess.Popen, job: Path, step: int, timeout: float = 300) -> None:
    """Until rank 0 has logged `step` (every rank is then inside the training loop, signal handlers installed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training ended (exit code {proc.returncode}) before step {step}: "
                                 f"{proc.stderr.read()[-3000:]}")
        if (job / "metrics.jsonl").is_file() and max(losses(job), default=0) >= step:
            return
        time.sleep(0.01)
    raise AssertionError(f"no step {step} in {job / 'metrics.jsonl'} after {timeout} s")


def assert_stopped_with_checkpoint(job: Path, reason: str) -> int:
    """The job stopped before its last step, with a complete checkpoint of the step it stopped after; returns it."""
    request = json.loads((job / REQUEUE_FILE).read_text())
    step = request["step"]
    assert request["reason"] == reason and 1 <= step < STEPS, request
    assert request["checkpoint"] == f"step-{step}" and "time" in request
    checkpoint = job / "checkpoints" / f"step-{step}"
    assert os.readlink(job / "checkpoints" / "latest") == f"step-{step}"
    assert (checkpoint / ".metadata").is_file()
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert max(losses(job)) == step  # no step after the one saved
    assert not (job / STOP_FILE).exists() and not (job / COMPLETED_FILE).exists()
    return step


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in root.rglob("*")}


def test_stop_file_then_sigterm_then_resume_gives_the_uninterrupted_losses(corpus, tmp_path, capsys):
    """One job stopped twice, as by a time-limit warning and then a preemption, and resumed each time with
    `maester train JOB`: the losses are bit-identical to a run without stops. The SIGTERM comes from outside, to
    a process of its own; the other commands run in this process, which has imported torch already."""
    expected = train_straight(corpus, tmp_path)
    job = tmp_path / "jobs" / "stopped"

    # The stop file, as the SLURM script's trap writes it; here it is there from the start.
    job.mkdir(parents=True)
    (job / STOP_FILE).touch()
    with pytest.raises(SystemExit) as exit_, SavedCheckpoints() as saves:
        main(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "stopped", **RUN)])
    assert exit_.value.code == REQUEUE_EXIT_CODE
    assert f"wrote {job / REQUEUE_FILE}; exiting with code {REQUEUE_EXIT_CODE}" in capsys.readouterr().out
    assert assert_stopped_with_checkpoint(job, STOP_FILE) == 1
    assert saves.paths == [job / "checkpoints" / "step-1"]  # checkpoint.interval = 0: saved for the stop

    # SIGTERM mid-run, as SLURM and torchrun send it.
    with started(["-m", "maester", "train", str(job)], tmp_path) as proc:
        wait_for_step(proc, job, 3)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE_EXIT_CODE, stderr[-3000:]
    assert f"resumed from {job / 'checkpoints' / 'step-1'}" in stderr
    stopped_at = assert_stopped_with_checkpoint(job, "SIGTERM")
    assert stderr.count("saved checkpoint") == 1

    main(["train", str(job)])
    assert f"resumed from {job / 'checkpoints' / f'step-{stopped_at}'}" in (job / "logs" / "train.log").read_text()
    got = losses(job)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])  # bitwise: JSON keeps every bit
    assert json.loads((job / COMPLETED_FILE).read_text())["step"] == STEPS
    assert not (job / REQUEUE_FILE).exists()  # the request was served by this run
    # each stop is an event line, which `maester status` counts
    stops = [(e["step"], e["reason"], e["checkpoint"]) for e in read_events(job)
             if e["event"] == "stop"]
    assert stops == [(1, STOP_FILE, "step-1"), (stopped_at, "SIGTERM", f"step-{stopped_at}")]

    # A later link of a chain: nothing to do, and nothing in the job directory changes.
    before = snapshot(job)
    capsys.readouterr()
    main(["train", str(job)])
    assert f"training completed at step {STEPS} (training.steps = {STEPS}): nothing to do" in capsys.readouterr().err
    assert snapshot(job) == before


def test_stop_after_a_saved_step_saves_nothing_more(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "saved", training__steps=4,
                                           checkpoint__interval=1), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    (cfg.job_dir / STOP_FILE).touch()
    with SavedCheckpoints() as saves:
        result = trainer.train()
    assert (result.step, result.stop_reason, result.checkpoint.name) == (1, STOP_FILE, "step-1")
    assert saves.paths == [cfg.job_dir / "checkpoints" / "step-1"]
    assert assert_stopped_with_checkpoint(cfg.job_dir, STOP_FILE) == 1


class SavedCheckpoints(logging.Handler):
    """Collects the checkpoints the trainer reports saving while the context is open."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.paths: list[Path] = []

    def __enter__(self) -> SavedCheckpoints:
        logging.getLogger("maester").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("maester").removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "saved checkpoint %s":
            self.paths.append(Path(record.args[0]))


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(corpus, tmp_path):
    """torchrun with 2 gloo workers; SIGUSR1 to rank 1 alone. Rank 0, which writes the files, stops too, after the
    same step: the checkpoint (a collective save) holds both ranks' state, and neither rank hangs."""
    job = tmp_path / "jobs" / "two"
    with started(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "maester", "train",
                  str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "two", **RUN)], tmp_path) as proc:
        wait_for_step(proc, job, 2)
        workers = {environ(pid).get("RANK"): pid for pid in children(proc.pid)}
        assert set(workers) == {"0", "1"}, workers
        os.kill(workers["1"], signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=120)
    # torchrun fails when a worker exits with an error code, and ends the others (with SIGTERM) if they are still
    # shutting down: the exit code of the first to leave is REQUEUE_EXIT_CODE; the files say the rest.
    assert proc.returncode != 0
    assert f"exitcode  : {REQUEUE_EXIT_CODE} (pid" in stderr, stderr[-4000:]
    step = assert_stopped_with_checkpoint(job, "SIGUSR1")
    assert sorted(p.name for p in (job / "checkpoints" / f"step-{step}" / "rng").iterdir()) == ["rank0.pt",
                                                                                              "rank1.pt"]


def children(pid: int) -> list[int]:
    return [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat") if _parent(p) == pid]


def descendants(pid: int) -> list[int]:
    return [d for child in children(pid) for d in (child, *descendants(child))]


def _parent(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):  # a process that ended while we looked
        return None


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_signals_set_a_flag_until_the_handlers_are_restored(tmp_path):
    previous = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    stops = StopRequests(tmp_path, rank=0)
    stops.install()
    try:
        assert stops.agree() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stops.agree() == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.agree() == "SIGTERM"  # the stronger request wins
    finally:
        stops.restore()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == previous
    (tmp_path / STOP_FILE).touch()
    assert StopRequests(tmp_path, rank=0).agree() == STOP_FILE
    assert StopRequests(tmp_path, rank=1).agree() is None  # rank 0 looks for the file


def test_raising_steps_continues_a_completed_run(corpus, tmp_path):
    job = tmp_path / "jobs" / "more"
    main(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "more", training__steps=2,
                                                     checkpoint__interval=0)])
    marker = json.loads((job / COMPLETED_FILE).read_text())
    assert marker["step"] == 2 and marker["checkpoint"] == "step-2"
    assert completed_marker(job, 2) == marker and completed_marker(job, 3) is None

    main(["train", str(job), "--training.steps=3"])
    assert max(losses(job)) == 3
    assert json.loads((job / COMPLETED_FILE).read_text())["step"] == 3

    (job / COMPLETED_FILE).write_text("{")
    with pytest.raises(ValueError, match=re.escape(f"{job / COMPLETED_FILE}: not valid JSON")):
        completed_marker(job, 3)
