"""SIGTERM to the whole process group, as SLURM sends it on requeue, scancel, preemption and the time limit: the
loader workers leave the stop to the main process, which saves a checkpoint, writes the requeue marker and exits
with REQUEUE_EXIT_CODE; the resumed run ends on the losses of a run that was never stopped."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from benchmarks.chaos import children_of
from maester.train.metrics_file import read_metrics
from maester.train.preemption import REQUEUE_EXIT_CODE, REQUEUE_FILE
from tests.data.test_sft import write_conversations
from tests.helpers import DEMO_CONFIG, run_maester, start_maester, tiny_overrides, write_corpus

STEPS = 30


def overrides(tmp_path, mode: str, name: str) -> list[str]:
    extra = dict(training__steps=STEPS, checkpoint__interval=0, data__num_workers=2,
                 training__global_batch_size=16, training__micro_batch_size=4)
    if mode == "sft":
        data = tmp_path / "chats.jsonl"
        if not data.exists():
            write_conversations(data, 200)
        extra.update(data__mode="sft", data__seq_len=128, data__sources=json.dumps([{"path": str(data)}]))
    else:
        data = tmp_path / "corpus.parquet"
        if not data.exists():
            write_corpus(data)
    return tiny_overrides(data, tmp_path / "jobs", name, **extra)


def losses(job) -> dict[int, float]:
    """Read while the trainer appends: a last line still being written is not a record yet."""
    return {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("mode", ["pretrain", "sft"])
def test_sigterm_to_the_process_group_stops_cleanly_and_resumes(tmp_path, mode):
    straight = run_maester(["train", str(DEMO_CONFIG), *overrides(tmp_path, mode, "straight")], cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    job = tmp_path / "jobs" / "stopped"
    proc = start_maester(["train", str(DEMO_CONFIG), *overrides(tmp_path, mode, "stopped")], tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not ((job / "metrics.jsonl").is_file() and max(losses(job), default=0) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.output()[1][-3000:]
            time.sleep(0.01)
        if mode == "pretrain":
            assert len(children_of(proc.pid)) >= 2  # the loader's workers are in the group too
        os.killpg(proc.pid, signal.SIGTERM)  # kill -TERM -- -PGID
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == REQUEUE_EXIT_CODE, err[-3000:]
    assert "Traceback" not in err
    request = json.loads((job / REQUEUE_FILE).read_text())
    assert request["reason"] == "SIGTERM" and (job / "checkpoints" / request["checkpoint"]).is_dir()
    resumed = run_maester(["train", str(job)], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(job) == losses(tmp_path / "jobs" / "straight")
