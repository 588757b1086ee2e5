"""Muon inside the trainer: it trains, a 2-process FSDP2 run computes the one-process losses, and a resumed run
continues bit for bit (its momentum buffers are in the checkpoint)."""

from __future__ import annotations

import shutil

import pytest

from maester.config import load_config
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer, write_seed_checkpoint
from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, torchrun, write_corpus

STEPS = 6
MUON = dict(optimizer__name="muon", optimizer__lr=3e-3, optimizer__muon__lr=0.02, training__steps=STEPS,
            training__global_batch_size=8, training__micro_batch_size=2, schedule__warmup_steps=1,
            schedule__name="constant",
            checkpoint__interval=0, checkpoint__save_final="false")


def losses(job_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(job_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    corpus = write_corpus(root / "data" / "corpus.parquet")
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "one", logging__interval=1, **MUON), environ={})
    write_seed_checkpoint(cfg, cfg.job_dir)
    shutil.copytree(cfg.job_dir / "checkpoints", root / "seed", symlinks=True)
    trainer = Trainer(cfg, cfg.job_dir)
    assert {g["name"]: g["muon"] for g in trainer.optimizer.param_groups} == {
        "embeddings/adamw": False, "no_decay/adamw": False, "decay/muon": True, "decay/adamw": False}
    trainer.train()
    return root, corpus, losses(cfg.job_dir)


def test_muon_trains(reference):
    *_, got = reference
    assert len(got) == STEPS and got[-1] < got[0] - 0.3


def test_fsdp2_muon_equals_one_process(reference):
    root, corpus, expected = reference
    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG),
                       *tiny_overrides(corpus, root / "jobs", "fsdp2", logging__interval=1, **MUON)], root)
    assert out.returncode == 0, out.stderr
    job = root / "jobs" / "fsdp2"
    shutil.copytree(root / "seed", job / "checkpoints", symlinks=True, dirs_exist_ok=True)
    run = torchrun(2, ["train", str(job)], root)
    assert run.returncode == 0, run.stderr[-4000:]
    assert losses(job) == pytest.approx(expected, rel=1e-5)


def test_muon_resume_is_exact(reference):
    root, corpus, expected = reference
    overrides = tiny_overrides(corpus, root / "jobs", "resumed", logging__interval=1,
                               **{**MUON, "checkpoint__interval": 3})
    cfg = load_config(None, overrides, environ={})
    shutil.copytree(root / "seed", cfg.job_dir / "checkpoints", symlinks=True)
    first = Trainer(load_config(None, [*overrides, "--training.steps=3"], environ={}), cfg.job_dir)
    first.train()
    second = Trainer(cfg, cfg.job_dir)
    assert second.step == 3 and all("momentum_buffer" in s or "exp_avg" in s for s in second.optimizer.state.values())
    second.train()
    assert losses(cfg.job_dir) == expected
