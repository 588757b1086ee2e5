"""SFT through the trainer: padding and label metrics, validation loss, exact resume, and the demo configs."""

from __future__ import annotations

import json
import math

import pytest

from maester.config import load_config
from maester.data.batch import BatchPlan
from maester.data.batch import IGNORE_INDEX
from maester.data.loader import build_loader
from maester.data.tokenizers import build_tokenizer
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.data.test_sft import write_conversations
from tests.helpers import DEMO_CONFIG, REPO, run_maester, tiny_overrides


def sft_config(chats, tmp_path, name="sft", **extra):
    values = dict(data__mode="sft", data__seq_len=256, data__sources=json.dumps([
        {"path": str(chats), "validation_fraction": 0.2}]), training__steps=6, logging__eval_interval=3,
        schedule__name="constant", schedule__warmup_steps=0)
    values.update(extra)
    return load_config(None, tiny_overrides(chats, tmp_path / "jobs", name, **values), environ={})


def test_sft_run_logs_padding_labels_and_validation(tmp_path):
    chats = tmp_path / "chats.jsonl"
    write_conversations(chats, 80)
    cfg = sft_config(chats, tmp_path)
    result = Trainer(cfg, cfg.job_dir).train()
    assert result.step == 6
    records = read_metrics(cfg.job_dir / "metrics.jsonl")
    first = records[0]
    # the label tokens of the first step, counted independently from a fresh loader
    fresh = build_loader(cfg.data, cfg.tokenizer, build_tokenizer(cfg.tokenizer), seed=0,
                         batch=BatchPlan(4, 2))
    batches = fresh.next_step()
    labels = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    real = sum(int((b.document_ids >= 0).sum()) for b in batches)
    assert first["label_tokens_per_step"] == labels
    assert first["padding_efficiency"] == pytest.approx(real / (4 * 256))
    assert 0 < first["padding_efficiency"] < 1
    assert first["documents_per_step"] >= 4 and first["document_tokens_max"] <= 256
    assert {r["step"] for r in records if "val_loss" in r} == {3, 6}
    assert all(math.isfinite(r["val_loss"]) for r in records if "val_loss" in r)
    assert records[-1]["data/chats.jsonl/conversations"] > 0


def test_sft_resume_continues_exactly(tmp_path):
    chats = tmp_path / "chats.jsonl"
    write_conversations(chats, 60)
    straight = sft_config(chats, tmp_path, "straight", logging__eval_interval=0, checkpoint__interval=0)
    Trainer(straight, straight.job_dir).train()
    first = sft_config(chats, tmp_path, "resumed", logging__eval_interval=0, training__steps=3)
    Trainer(first, first.job_dir).train()
    second = sft_config(chats, tmp_path, "resumed", logging__eval_interval=0)
    trainer = Trainer(second, second.job_dir)
    assert trainer.step == 3
    trainer.train()
    a = {r["step"]: r["loss"] for r in read_metrics(straight.job_dir / "metrics.jsonl")}
    b = {r["step"]: r["loss"] for r in read_metrics(second.job_dir / "metrics.jsonl")}
    for step in range(1, 7):
        assert a[step] == pytest.approx(b[step], rel=1e-5), step


@pytest.mark.slow
def test_demo_sft_config_finetunes_a_pretrained_job(tmp_path):
    """The shipped SFT config, shortened: it starts from a pretrained demo job and trains on the built-in chats."""
    pre = run_maester(["train", str(DEMO_CONFIG), "--training.steps=2", "--data.seq_len=64", "--schedule.warmup_steps=0",
                       "--checkpoint.interval=0"], cwd=tmp_path)
    assert pre.returncode == 0, pre.stderr[-2000:]
    sft = run_maester(["train", str(REPO / "configs" / "demo-sft.toml"), "--training.steps=2", "--schedule.warmup_steps=0",
                       "--logging.eval_interval=2", "--logging.interval=1", "--data.seq_len=256"], cwd=tmp_path)
    assert sft.returncode == 0, sft.stderr[-2000:]
    assert "initialised" in sft.stderr or "from" in sft.stderr
    records = read_metrics(tmp_path / "jobs" / "demo-sft" / "metrics.jsonl")
    assert records[-1]["step"] == 2 and math.isfinite(records[-1]["val_loss"])
    assert 0 < records[0]["padding_efficiency"] <= 1
    answer = run_maester(["generate", "jobs/demo-sft", "--chat", "--prompt", "What does `os.getcwd` do?",
                          "--max-new-tokens", "8"], cwd=tmp_path)
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert "<|im_start|>" not in answer.stdout and len(answer.stdout.removesuffix("\n").encode()) <= 8 * 4
