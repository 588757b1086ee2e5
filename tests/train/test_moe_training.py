"""A mixture-of-experts model in the trainer: a tiny Qwen 3 MoE trains with finite, falling loss over micro-batches,
logs the experts' load and losses, and with auxiliary-loss-free balancing moves its selection bias every step."""

from __future__ import annotations

import json
import math

import torch

from maester.config import load_config
from maester.models.moe import moe_layers
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides


def train(corpus, root, name, steps=5, **extra):
    cfg = load_config(None, tiny_overrides(corpus, root, name, model__name="qwen3_moe", training__steps=steps,
                                           checkpoint__interval=0, checkpoint__save_final="false", **extra),
                      environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    trainer.train()
    return trainer, read_metrics(cfg.job_dir / "metrics.jsonl")


def test_a_tiny_moe_trains_and_logs_its_experts(corpus, tmp_path):
    _, records = train(corpus, tmp_path, "moe", steps=6)  # 2 micro-batches a step
    losses = [r["loss"] for r in records]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2])
    last = records[-1]
    for layer in (0, 1):
        key = f"moe/layers.{layer}"
        assert 0 <= last[f"{key}/load_min"] <= 1 <= last[f"{key}/load_max"] <= 8
        assert 0 < last[f"{key}/load_entropy"] <= 1
        assert last[f"{key}/balance_loss"] >= 2 - 1e-4  # top_k 2 when balanced, more otherwise
        assert last[f"{key}/z_loss"] > 0


def test_bias_balancing_moves_the_selection_bias_from_a_partial_override(corpus, tmp_path):
    overrides = json.dumps({"moe": {"bias_balancing": 0.01, "aux_loss_coef": 0.0}})
    trainer, records = train(corpus, tmp_path, "bias", steps=3, model__overrides=overrides)
    assert all(math.isfinite(r["loss"]) for r in records)
    for layer in moe_layers(trainer.model):
        bias = layer.router.expert_bias
        assert layer.moe.n_experts == 8 and layer.moe.bias_balancing == 0.01  # the flavor's, with the override
        assert bias.abs().max() > 0 and bias.sum().abs() < 1e-5
        assert torch.equal(layer.load, torch.zeros(8))  # restarted after the last step


def test_exact_resume_keeps_the_selection_bias(corpus, tmp_path):
    """4 uninterrupted steps == 2 steps, a SIGKILL after step 3, then a resume to 4 from step 2's checkpoint:
    bit-identical losses; the bias balancing state (the selection bias) is in the checkpoint."""
    import os
    import signal

    from tests.helpers import DEMO_CONFIG, clean_env, run_maester

    def args(name):
        overrides = json.dumps({"moe": {"bias_balancing": 0.01}})
        return ["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", name, model__name="qwen3_moe",
                                                           model__overrides=overrides, training__steps=4,
                                                           checkpoint__interval=2)]

    straight = run_maester(args("straight"), tmp_path)
    assert straight.returncode == 0, straight.stderr
    killed = run_maester(args("resumed"), tmp_path, env=clean_env(_MAESTER_FAULT="after_step:3"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    job = tmp_path / "jobs" / "resumed"
    assert os.readlink(job / "checkpoints" / "latest") == "step-2"
    resumed = run_maester(["train", str(job)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    a = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "jobs" / "straight" / "metrics.jsonl")}
    b = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert a[3] == b[3] and a[4] == b[4]


def test_activation_checkpointing_trains_as_without(corpus, tmp_path):
    """Full and selective-op checkpointing recompute the MoE blocks (aux losses included): the same losses and
    load as without (that a recomputation is not counted is tested on the layer, in tests/models/test_moe.py)."""
    _, plain = train(corpus, tmp_path, "plain", steps=2)
    for mode in ("full", "selective-op"):
        _, checkpointed = train(corpus, tmp_path, mode, steps=2, parallel__activation_checkpointing=mode)
        for a, b in zip(plain, checkpointed):
            assert a["loss"] == b["loss"] and a["moe/layers.0/load_max"] == b["moe/layers.0/load_max"], mode
