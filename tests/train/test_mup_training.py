"""μP in training: at m = 1 a μP run is the standard run (same losses, step for step), for Llama with AdamW and
Gemma 3 with Muon; at m > 1 the hidden-matrix LR is the base LR / m in the live optimizer."""

from __future__ import annotations

import pytest

from maester.config import load_config
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides

STEPS = 4


def run(corpus, root, name, **extra) -> list[float]:
    cfg = load_config(None, tiny_overrides(corpus, root, name, training__steps=STEPS, checkpoint__interval=0,
                                           checkpoint__save_final="false", **extra), environ={})
    Trainer(cfg, cfg.job_dir).train()
    return [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")]


@pytest.mark.parametrize("model, optimizer", [("llama", "adamw"), ("gemma3", "muon")])
def test_mup_at_base_width_trains_exactly_like_the_standard_model(corpus, tmp_path, model, optimizer):
    common = dict(model__name=model, optimizer__name=optimizer)
    standard = run(corpus, tmp_path, "standard", **common)
    mup = run(corpus, tmp_path, "mup", mup__enabled="true", mup__base_width=64, **common)  # tiny: dim 64
    assert len(mup) == STEPS and mup == standard
    wider = run(corpus, tmp_path, "wider", mup__enabled="true", mup__base_width=32, **common)  # m = 2
    assert wider != standard


def test_hidden_lr_is_divided_by_the_width_multiplier(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path, "m4", model__width=256, mup__enabled="true",
                                           mup__base_width=64, training__steps=2), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    lrs = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert lrs == {"embeddings": 3e-3, "no_decay": 3e-3, "decay/mup0.25": 3e-3 / 4, "decay": 3e-3}
    trainer.loader.close()
