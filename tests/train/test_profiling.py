"""Profiler traces per rank from real training runs (window, resume, ranks), and CUDA memory snapshots."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from maester.cli import main
from maester.config import ProfilingConfig, load_config
from maester.jobs.job_dir import write_job_dir
from maester.train.profiling import Profiler
from maester.train.trainer import Trainer
from tests.helpers import DEMO_CONFIG, tiny_overrides, torchrun


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def step_markers(events: list[dict]) -> list[dict]:
    """The `ProfilerStep#<N>` markers of the host timeline, in order."""
    return sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
                  key=lambda e: e["ts"])


def marker_names(path: Path) -> list[str]:
    return [e["name"] for e in step_markers(trace_events(path))]


def profile_files(job_dir: Path) -> list[str]:
    root = job_dir / "profiles"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def train(corpus: Path, tmp_path: Path, **extra) -> Path:
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "prof", **extra), environ={})
    Trainer(cfg, cfg.job_dir).train()
    return cfg.job_dir


def test_window_of_a_training_run_is_traced(corpus, tmp_path):
    """Steps 2-3 after one warm-up step, of 5: one gzipped Chrome trace with ops and one marker per traced step."""
    job = train(corpus, tmp_path, training__steps=5, checkpoint__interval=0, checkpoint__save_final="false",
                profiling__enabled="true", profiling__start_step=2, profiling__steps=2, profiling__warmup_steps=1)
    assert profile_files(job) == ["step-2/rank-0.trace.json.gz"]
    events = trace_events(job / "profiles" / "step-2" / "rank-0.trace.json.gz")
    assert any(e.get("name", "").startswith("aten::") for e in events)
    markers = step_markers(events)
    assert [e["name"] for e in markers] == ["ProfilerStep#2", "ProfilerStep#3"]
    # The ops of a step lie inside its marker: the model's matmuls ran in both traced steps.
    for m in markers:
        inside = [e for e in events if e.get("name") == "aten::mm" and m["ts"] <= e["ts"] <= m["ts"] + m["dur"]]
        assert inside, m["name"]
    assert "profiling: wrote the trace of steps 2-3" in (job / "logs" / "train.log").read_text()


def test_resumed_after_the_window_takes_no_trace(corpus, tmp_path):
    """Window: step 2 after one warm-up step, so the profiler starts before step 1; the run resumes at step 3."""
    first = train(corpus, tmp_path, training__steps=2, checkpoint__interval=0)
    assert (first / "checkpoints" / "step-2").is_dir()
    job = train(corpus, tmp_path, training__steps=3, checkpoint__interval=0, checkpoint__save_final="false",
                profiling__enabled="true", profiling__start_step=2, profiling__steps=1, profiling__warmup_steps=1)
    assert job == first
    assert profile_files(job) == []
    log = (job / "logs" / "train.log").read_text()
    assert "resumed from" in log
    assert "profiling: this run starts at step 3, after the traced step 2: no trace is taken" in log


@pytest.mark.slow
def test_every_rank_writes_its_trace(corpus, tmp_path):
    cfg = load_config(DEMO_CONFIG, tiny_overrides(corpus, tmp_path / "jobs", "ranks", training__steps=3,
                                                  checkpoint__interval=0, checkpoint__save_final="false",
                                                  profiling__enabled="true", profiling__start_step=2,
                                                  profiling__steps=1), environ={})
    write_job_dir(cfg)
    run = torchrun(2, ["train", str(cfg.job_dir)], tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "gpuGetDeviceCount failed" not in run.stderr  # kineto's GPU probe is quiet on a CPU run
    assert profile_files(cfg.job_dir) == ["step-2/rank-0.trace.json.gz", "step-2/rank-1.trace.json.gz"]
    for rank in (0, 1):
        path = cfg.job_dir / "profiles" / "step-2" / f"rank-{rank}.trace.json.gz"
        assert marker_names(path) == ["ProfilerStep#2"]


def test_memory_snapshot_on_cpu_is_a_clear_error(corpus, tmp_path, monkeypatch, capsys):
    for name in [k for k in os.environ if k.startswith("MAESTER_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exit:
        main(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "snap",
                                                         profiling__memory_snapshot="true")])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "maester train: error: profiling.memory_snapshot = true needs a CUDA device" in err
    assert "trains on cpu" in err


# The Profiler on its own, driven like the training loop drives it (`step(n)` after step n), around real ops.

def run_steps(profiler: Profiler, steps: range) -> None:
    layer = torch.nn.Linear(16, 16)
    for n in steps:
        layer(torch.randn(4, 16)).sum().backward()
        profiler.step(n)
    profiler.close()


def profiler(tmp_path: Path, **cfg) -> Profiler:
    return Profiler(ProfilingConfig(**cfg), tmp_path, 0, torch.device("cpu"))


def test_disabled_profiler_writes_nothing(tmp_path):
    p = profiler(tmp_path, start_step=1, steps=2, warmup_steps=0)
    run_steps(p, range(1, 4))
    assert not (tmp_path / "profiles").exists()


@pytest.mark.parametrize(("window", "warmup", "run_from", "traced"), [
    ((3, 4), 0, 4, [5, 6]),  # resumed after step 3, inside steps 3-6: steps 5-6 are traced
    ((3, 4), 3, 4, [5, 6]),  # the same, with the profiler started before step 1 (it first records step 4 as 1)
    ((1, 3), 0, 2, [3]),  # step 1 is traced, so the step-2 recording of the resumed run must be thrown away
    ((2, 2), 1, 3, []),  # resumed at the last traced step (3): nothing left to trace
], ids=["warmup-0", "started-before-step-1", "recording-step-1", "at-the-last-step"])
def test_run_resumed_inside_the_window_traces_the_steps_left(tmp_path, window, warmup, run_from, traced):
    start, steps = window
    run_steps(profiler(tmp_path, enabled=True, start_step=start, steps=steps, warmup_steps=warmup),
              range(run_from, 9))
    if not traced:
        assert profile_files(tmp_path) == []
        return
    assert profile_files(tmp_path) == [f"step-{traced[0]}/rank-0.trace.json.gz"]
    assert marker_names(tmp_path / "profiles" / f"step-{traced[0]}" / "rank-0.trace.json.gz") == \
        [f"ProfilerStep#{n}" for n in traced]


def test_window_past_the_end_of_training_is_written_at_close(tmp_path):
    run_steps(profiler(tmp_path, enabled=True, start_step=2, steps=5, warmup_steps=1), range(1, 4))
    assert profile_files(tmp_path) == ["step-2/rank-0.trace.json.gz"]
    # Steps 2 and 3 ran; the marker of step 4 spans the time from the last step to close().
    assert marker_names(tmp_path / "profiles" / "step-2" / "rank-0.trace.json.gz") == \
        ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]


def test_training_that_ends_in_the_warmup_writes_no_trace(tmp_path):
    run_steps(profiler(tmp_path, enabled=True, start_step=5, steps=2, warmup_steps=2), range(1, 4))
    assert profile_files(tmp_path) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trace_and_memory_snapshots(tmp_path):
    """Kernels in the trace; a snapshot after the window and one on (a simulated) out-of-memory, each a pickle
    of the allocator's segments that hold the step's tensors."""
    device = torch.device("cuda")
    p = Profiler(ProfilingConfig(enabled=True, start_step=2, steps=1, warmup_steps=1, memory_snapshot=True),
                 tmp_path, 0, device)
    held = []
    for n in range(1, 4):
        held.append(torch.randn(256, 256, device=device) @ torch.randn(256, 256, device=device))
        torch.cuda.synchronize()
        p.step(n)
    p.on_oom(4)  # what the loop calls when step 4 raises torch.OutOfMemoryError
    p.close()
    assert profile_files(tmp_path) == ["memory/rank-0-oom-step-4.pickle", "memory/rank-0-step-2.pickle",
                                       "step-2/rank-0.trace.json.gz"]
    events = trace_events(tmp_path / "profiles" / "step-2" / "rank-0.trace.json.gz")
    assert any(e.get("cat") == "kernel" for e in events)
    for name, tensors in (("rank-0-step-2.pickle", 2), ("rank-0-oom-step-4.pickle", 3)):
        with open(tmp_path / "profiles" / "memory" / name, "rb") as f:
            snapshot = pickle.load(f)
        assert snapshot["segments"], name
        blocks = [b for segment in snapshot["segments"] for b in segment["blocks"]]
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        assert allocated >= tensors * 256 * 256 * 4, name
        assert any(e["action"] == "alloc" for trace in snapshot["device_traces"] for e in trace), name
    # Recording stopped at close: a new allocation is not in the history.
    def allocations() -> int:
        return sum(e["action"] == "alloc" for trace in torch.cuda.memory._snapshot()["device_traces"] for e in trace)

    before = allocations()
    held.append(torch.empty(1 << 20, device=device))
    assert allocations() == before
