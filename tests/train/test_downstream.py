"""In-loop downstream evaluation on one process: `eval/<task>/<metric>` at the configured steps in metrics.jsonl and
TensorBoard, a task that fails logged while training goes on, evaluation time kept out of the steps' timing, and
the evaluation keys checked before any work. (FSDP, and resuming after a kill: tests/distributed.)"""

from __future__ import annotations

import json
import re

import pytest
import torch

from maester.config import load_config
from maester.config_base import ConfigError
from maester.train.metrics_file import read_events
from tests.helpers import tiny_overrides

BROKEN_TASK = """task: broken_task
dataset_path: json
dataset_kwargs:
  data_files: {missing}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
"""


def broken_task(directory) -> str:
    """A task file and its data file, `missing.jsonl`: once that is removed, the task fails when it loads."""
    path = directory / "broken.yaml"
    path.write_text(BROKEN_TASK.format(missing=directory / "missing.jsonl"))
    (directory / "missing.jsonl").write_text(json.dumps({"question": "q", "choices": ["a", "b"], "label": 0}) + "\n")
    return str(path)


def offline(monkeypatch, tmp_path) -> None:
    for name, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(name, value)


def test_tasks_are_logged_a_failing_one_too_and_their_time_is_not_the_steps(corpus, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from maester.jobs.job_dir import write_job_dir
    from maester.train.trainer import Trainer

    import lm_eval.evaluator

    offline(monkeypatch, tmp_path)
    reported = []  # lm-eval's environment report (torch's collect_env: seconds) is not made per task in the loop
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", reported.append)
    tasks = json.dumps(["pydoc_choice", broken_task(tmp_path)])
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "ev", training__steps=3, checkpoint__interval=0,
                                           evaluation__tasks=tasks, evaluation__interval=2, evaluation__limit=40, training__cpu_threads=1,
                                           logging__tensorboard__enabled="true"), environ={})
    write_job_dir(cfg)
    trainer = Trainer(cfg, cfg.job_dir)  # the tasks are built once here, the broken one with its data
    (tmp_path / "missing.jsonl").unlink()  # which is gone when it is evaluated
    assert trainer.train().step == 3  # the failing task raised nothing out of the loop
    assert reported == []
    lines = [json.loads(line) for line in (cfg.job_dir / "metrics.jsonl").read_text().splitlines()]
    failed = [r for r in read_events(cfg.job_dir) if r["event"] == "eval_failed"]
    assert [r["step"] for r in failed] == [2, 3]
    assert all(r["task"].endswith("broken.yaml") and "missing.jsonl" in r["error"] for r in failed)
    evals = [r for r in lines if "eval/seconds" in r]
    assert [r["step"] for r in evals] == [2, 3]
    assert all(0 <= r["eval/pydoc_choice/acc"] <= 1 and 0 <= r["eval/pydoc_choice/acc_norm"] <= 1 for r in evals)
    # Step 3's window began before the evaluation of step 2, which took far longer than a step.
    step_3 = next(r for r in lines if r["step"] == 3 and "loss" in r)
    assert step_3["step_seconds"] < evals[0]["eval/seconds"] / 2, (step_3["step_seconds"], evals[0])
    events = EventAccumulator(str(cfg.job_dir / "tensorboard"))
    events.Reload()
    logged = events.Scalars("eval/pydoc_choice/acc")
    assert [(e.step, e.value) for e in logged] == [(r["step"], pytest.approx(r["eval/pydoc_choice/acc"])) for r in evals]

    # `maester report` draws a row of the tasks below the training curves and lists the last evaluation.
    from PIL import Image

    from maester.tools.report import write_report

    report = write_report(cfg.job_dir)
    assert re.search(r"\n  downstream eval +at step 3\n", report.summary), report.summary
    acc = evals[-1]["eval/pydoc_choice/acc"]
    assert re.search(rf"\n    pydoc_choice +acc {acc:.4g}, acc_norm ", report.summary), report.summary
    with Image.open(report.png) as image:
        assert image.size == (1500, 1200)


@pytest.mark.parametrize("overrides, message", [
    ({"evaluation__interval": 5}, "evaluation.interval = 5, but evaluation.tasks names no task"),
    ({"evaluation__tasks": '["pydoc_choice"]', "parallel__pp": 2}, "not with parallel.pp = 2"),
    ({"evaluation__tasks": '["pydoc_choice"]', "evaluation__limit": 0}, "evaluation.limit"),
])
def test_evaluation_keys_are_checked_with_the_config(corpus, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, tiny_overrides(corpus, tmp_path, **overrides), environ={})


def test_a_missing_task_file_stops_the_run_before_it_trains(corpus, tmp_path, monkeypatch):
    from maester.train.trainer import Trainer

    offline(monkeypatch, tmp_path)
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "missing",
                                           evaluation__tasks=json.dumps([str(tmp_path / "nope.yaml")])), environ={})
    with pytest.raises(FileNotFoundError, match="evaluation.tasks: the task file .*nope.yaml does not exist"):
        Trainer(cfg, cfg.job_dir)
    assert not (cfg.job_dir / "metrics.jsonl").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_in_bf16_the_loop_and_the_command_evaluate(corpus, tmp_path, monkeypatch):  # pragma: no cover
    """One GPU, bf16 autocast: the KV cache in the compute dtype on the device; then `maester eval` on the GPU
    (bfloat16 weights by default) on the job's checkpoint."""
    # The GPU check installs no lm-eval (its wheels, pyarrow's 55 MB among them, exceed the check's wheel budget):
    # there the test says so; a GPU machine with the eval extra runs it.
    pytest.importorskip("lm_eval", reason="needs the eval extra (lm-eval), which the GPU check does not install")
    from maester.jobs.job_dir import write_job_dir
    from maester.train.trainer import Trainer
    from tests.evaluation.conftest import run_eval

    offline(monkeypatch, tmp_path)
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "gpu", training__steps=2, training__device="cuda",
                                           training__precision="bf16", evaluation__limit=8,
                                           evaluation__tasks='["pydoc_choice", "pydoc_complete"]'), environ={})
    write_job_dir(cfg)
    Trainer(cfg, cfg.job_dir).train()
    lines = [json.loads(line) for line in (cfg.job_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in read_events(cfg.job_dir) if r["event"] == "eval_failed"]
    evals = [r for r in lines if "eval/seconds" in r]
    assert [r["step"] for r in evals] == [2] and "eval/pydoc_complete/exact_match" in evals[0]
    run_eval([cfg.job_dir, "--tasks", "pydoc_choice,pydoc_complete", "--limit", "8", "--device", "cuda",
              "--output", tmp_path / "gpu.json"], tmp_path)
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["config"]["dtype"] == "torch.bfloat16" and set(results["results"]) == {"pydoc_choice",
                                                                                          "pydoc_complete"}


def test_without_lm_eval_training_runs_and_evaluation_tasks_say_how_to_install_it(corpus, tmp_path, monkeypatch):
    import sys

    from maester.train.trainer import Trainer

    # As if not installed: `import lm_eval` (and of any of its modules an earlier test loaded) raises ImportError,
    # and maester's evaluation modules are imported afresh, as in a process without lm-eval.
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("maester.evaluation.")]:
        monkeypatch.delitem(sys.modules, name)
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "plain", training__steps=2), environ={})
    assert Trainer(cfg, cfg.job_dir).train().step == 2
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "evaluated", training__steps=2,
                                           evaluation__tasks='["pydoc_choice"]'), environ={})
    with pytest.raises(ValueError, match=r"pip install 'maester\[eval\]'"):
        Trainer(cfg, cfg.job_dir)
