"""In-loop downstream evaluation on the demo sharded with FSDP over two processes: `eval/*` at the configured steps
(metrics.jsonl and TensorBoard), a task made to fail logged on every evaluation while training goes on, and a run
killed with SIGKILL after an evaluation resumes to the same training losses, bit for bit."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import pytest

from maester.train.metrics_file import read_events

from tests.helpers import DEMO_CONFIG, REPO, clean_env, torchrun
from tests.train.test_downstream import broken_task


def metrics_lines(job) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


@contextmanager
def removed_while_standing_still(job, path, step: int, release):
    """Removes `path` while the run stands still after `step` (the `hang` fault until `release` exists), so that the
    broken task, built by every rank before step 1 with its data, fails when it is evaluated. Rank 0 stands still
    after it took the step, and so every rank has built its tasks (the step's collectives need them all)."""
    done = threading.Event()

    def watch():
        log = job / "logs" / "train.log"
        while not done.is_set():
            if log.is_file() and f"standing still at step {step} " in log.read_text():
                path.unlink()
                release.touch()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
    assert not path.exists(), f"the run ended before it stood still at step {step}"


def test_fsdp_evaluates_in_the_loop_and_resumes_bitwise(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tasks = json.dumps(["pydoc_choice", "pydoc_complete", broken_task(tmp_path)])
    overrides = [f"--{k}={v}" for k, v in {
        "job.name": "demo-eval", "job.dump_dir": tmp_path / "jobs", "model.flavor": "tiny", "data.seq_len": 64,
        "training.steps": 6, "training.global_batch_size": 4, "training.micro_batch_size": 2,
        "training.device": "cpu", "schedule.warmup_steps": 1, "checkpoint.interval": 3, "logging.interval": 1,
        "logging.tensorboard.enabled": "true", "parallel.dp_shard": 2, "evaluation.tasks": tasks,
        "evaluation.interval": 3, "evaluation.limit": 5, "evaluation.batch_size": 2}.items()]
    def env(fault: str, release: str) -> dict[str, str]:
        return clean_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
                         XDG_CACHE_HOME=str(tmp_path / "cache"), _MAESTER_FAULT=fault,
                         _MAESTER_HANG_UNTIL=str(tmp_path / release))

    job = tmp_path / "jobs" / "demo-eval"
    # Steps 1-5, evaluated and saved at step 3, then every rank is killed with SIGKILL after step 5.
    data = (tmp_path / "missing.jsonl").read_text()
    with removed_while_standing_still(job, tmp_path / "missing.jsonl", 1, tmp_path / "go-1"):
        killed = torchrun(2, ["train", str(DEMO_CONFIG), *overrides], tmp_path, env=env("hang:1,after_step:5", "go-1"),
                          timeout=600)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-2000:]
    before = {r["step"]: r["loss"] for r in metrics_lines(job) if "loss" in r}
    assert sorted(before) == [1, 2, 3, 4, 5]

    (tmp_path / "missing.jsonl").write_text(data)  # the tasks are built at the start, with their data
    with removed_while_standing_still(job, tmp_path / "missing.jsonl", 4, tmp_path / "go-4"):
        resumed = torchrun(2, ["train", str(job)], tmp_path, env=env("hang:4", "go-4"), timeout=600)  # evaluated at 6
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = metrics_lines(job)
    losses = {r["step"]: r["loss"] for r in lines if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(losses[s] == before[s] for s in (4, 5)), (before, losses)
    evals = [r for r in lines if "eval/seconds" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        assert {"eval/pydoc_choice/acc", "eval/pydoc_choice/acc_norm", "eval/pydoc_complete/exact_match"} <= r.keys()
    failed = [r for r in read_events(job) if r["event"] == "eval_failed"]
    assert [(r["step"], r["task"].endswith("broken.yaml")) for r in failed] == [(3, True), (6, True)]
    assert "missing.jsonl" in failed[0]["error"]
    events = EventAccumulator(str(job / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/pydoc_complete/exact_match")] == [3, 6]

    # The sharded model's results at step 6 are those of `maester eval` on its final checkpoint, on one process.
    from maester.evaluation.harness import flat_metrics
    from tests.evaluation.conftest import run_eval

    run_eval([job, "--tasks", "pydoc_choice,pydoc_complete", "--limit", "5", "--output", tmp_path / "final.json"],
             tmp_path)
    one = flat_metrics(json.loads((tmp_path / "final.json").read_text()))
    assert one == {k: v for k, v in evals[-1].items() if k.startswith("eval/") and k != "eval/seconds"}


def test_tensor_parallel_evaluates_as_the_whole_model_does(tmp_path):
    """Tensor and sequence parallel over two processes: every forward padded to a multiple of two positions, the
    decoding steps too, vocabulary-sharded logits gathered; the responses are the whole model's."""
    out = torchrun(2, [str(tmp_path)], tmp_path, timeout=600,
                   env=clean_env(OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                                 HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path / "cache")),
                   script=REPO / "tests" / "distributed" / "downstream_tp.py")
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (1, 0):  # rank 0's holds the results: lm-eval reports on the first process of a node only
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["sharded"] and result["failures"] == []
    assert result["metrics"] == result["expected_metrics"]
    assert set(result["metrics"]) == {"eval/pydoc_choice/acc", "eval/pydoc_choice/acc_norm",
                                      "eval/pydoc_complete/exact_match"}
    texts = [r[0] for r in result["responses"]["pydoc_complete"].values()]
    assert texts == [r[0] for r in result["expected"]["pydoc_complete"].values()]
    assert sum(bool(t) for t in texts) >= 3  # random weights: varied text before a stop string
    for doc, resps in result["responses"]["pydoc_choice"].items():
        wanted = result["expected"]["pydoc_choice"][doc]
        assert [r[0][0] for r in resps] == pytest.approx([r[0][0] for r in wanted], rel=1e-5)
