"""Checkpoints are elastic: a run moves between 4, 2 and 1 processes and continues the exact loss curve."""

from __future__ import annotations

import json
import shutil

import pytest

from maester.cli import main
from maester.config import load_config
from maester.train.metrics_file import read_events, read_metrics
from maester.train.trainer import Trainer, write_seed_checkpoint
from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, torchrun, write_corpus

# A constant schedule: extending training.steps between legs must not change the learning rate.
RUN = dict(training__global_batch_size=8, training__micro_batch_size=2, schedule__name="constant",
           schedule__warmup_steps=1, checkpoint__interval=2, checkpoint__keep_last=5)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    corpus = write_corpus(root / "data" / "corpus.parquet")
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "straight", training__steps=8, **RUN), environ={})
    write_seed_checkpoint(cfg, cfg.job_dir)
    shutil.copytree(cfg.job_dir / "checkpoints", root / "seed", symlinks=True)
    Trainer(cfg, cfg.job_dir).train()
    return root, corpus, {r["step"]: r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")}


def leg(nproc, job, steps, root):
    args = ["train", str(job), f"--training.steps={steps}"]
    out = torchrun(nproc, args, root) if nproc > 1 else run_maester(args, root)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((job / "checkpoints" / "latest" / "trainer_state.json").read_text())


def test_elastic_resume_continues_the_loss_curve(uninterrupted):
    """4 -> 1 rank, then up to 2: resharded model and optimizer, the same global data position."""
    ranks = (4, 1, 2)
    root, corpus, expected = uninterrupted
    name = "elastic-" + "-".join(map(str, ranks))
    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG), *tiny_overrides(corpus, root / "jobs", name, training__steps=2,
                                                                   **RUN)], root)
    assert out.returncode == 0, out.stderr
    job = root / "jobs" / name
    shutil.rmtree(job / "checkpoints")
    shutil.copytree(root / "seed", job / "checkpoints", symlinks=True)
    for i, nproc in enumerate(ranks):
        state = leg(nproc, job, 2 * (i + 1), root)
        assert state["step"] == 2 * (i + 1)
        # the data position is global: all 8 streams, gathered from every rank, one window per step each
        streams = state["data"]["states"]
        assert sorted(map(int, streams)) == list(range(8))
        assert all(s["windows"] == state["step"] for s in streams.values())
    got = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert sorted(got) == list(range(1, 2 * len(ranks) + 1))
    for step in sorted(got):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)


def test_async_saves_of_two_fsdp_ranks_resume_on_one(uninterrupted):
    """Two ranks (FSDP) save step 2 in the background and train on to step 3 (no final save); one process resumes
    from step 2 to step 4 and continues the straight run's loss curve, as with synchronous saves above."""
    root, corpus, expected = uninterrupted
    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG), *tiny_overrides(
        corpus, root / "jobs", "elastic-async", training__steps=3, checkpoint__save_final="false",
        checkpoint__async_mode="async", **RUN)], root)
    assert out.returncode == 0, out.stderr
    job = root / "jobs" / "elastic-async"
    shutil.rmtree(job / "checkpoints")
    shutil.copytree(root / "seed", job / "checkpoints", symlinks=True)
    out = torchrun(2, ["train", str(job)], root)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (job / "checkpoints" / "latest").resolve().name == "step-2"
    saves = [e for e in read_events(job) if e["event"].startswith("checkpoint")]
    assert [(e["event"], e["step"], e["background"]) for e in saves] == [("checkpoint", 2, True)]
    assert sorted(p.name for p in (job / "checkpoints" / "step-2").glob("*.distcp")) == ["__0_0.distcp",
                                                                                        "__1_0.distcp"]
    main(["train", str(job), "--training.steps=4"])  # one process, here
    assert json.loads((job / "checkpoints" / "latest" / "trainer_state.json").read_text())["step"] == 4
    got = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)
