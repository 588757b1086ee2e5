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
