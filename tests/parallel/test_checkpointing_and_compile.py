"""Activation checkpointing (each mode) and per-block compile change memory and speed, never the numbers."""

from __future__ import annotations

import pytest

from maester.config import load_config
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides

RUN = dict(training__steps=3, checkpoint__interval=0, checkpoint__save_final="false", schedule__warmup_steps=1)


def run_losses(corpus, tmp_path, name, **extra) -> list[float]:
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", name, **{**RUN, **extra}), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    trainer.train()
    return trainer, [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")]


@pytest.mark.parametrize("mode, every", [("full", 1), ("selective-op", 1), ("full", 2)])
def test_activation_checkpointing_keeps_losses(corpus, tmp_path, mode, every):
    _, plain = run_losses(corpus, tmp_path, "plain")
    trainer, checkpointed = run_losses(corpus, tmp_path, f"ac-{mode}-{every}",
                                       parallel__activation_checkpointing=mode,
                                       parallel__activation_checkpointing_every=every)
    wrapped = [type(b).__name__ for b in trainer.model.layers.values()]
    assert wrapped == ["CheckpointWrapper" if i % every == 0 else "TransformerBlock" for i in range(len(wrapped))]
    assert checkpointed == pytest.approx(plain, rel=1e-6)
    # the wrappers do not leak into checkpoint names
    assert all("_checkpoint_wrapped_module" not in k for k in _checkpoint_keys(trainer))


def _checkpoint_keys(trainer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return list(get_model_state_dict(trainer.model))


def test_compile_keeps_losses(corpus, tmp_path):
    _, plain = run_losses(corpus, tmp_path, "plain")
    trainer, compiled = run_losses(corpus, tmp_path, "compiled", parallel__compile="true")
    assert all(type(b).__name__ == "OptimizedModule" for b in trainer.model.layers.values())
    assert compiled == pytest.approx(plain, rel=1e-5)
    assert all("_orig_mod" not in k for k in _checkpoint_keys(trainer))


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "olmo2", "gpt_neox"])
def test_every_architecture_trains_and_selective_checkpointing_keeps_its_losses(corpus, tmp_path, name):
    steps = dict(training__steps=6, optimizer__lr="1e-2")
    _, plain = run_losses(corpus, tmp_path, f"{name}-plain", model__name=name, **steps)
    assert plain[-1] < plain[0] - 0.5, plain
    _, checkpointed = run_losses(corpus, tmp_path, f"{name}-ac", model__name=name, **steps,
                                 parallel__activation_checkpointing="selective-op")
    assert checkpointed == pytest.approx(plain, rel=1e-6)


def test_compile_keeps_the_losses_of_a_sliding_window_model(corpus, tmp_path):
    _, plain = run_losses(corpus, tmp_path, "gemma3-plain", model__name="gemma3")
    trainer, compiled = run_losses(corpus, tmp_path, "gemma3-compiled", model__name="gemma3", parallel__compile="true")
    assert all(type(b).__name__ == "OptimizedModule" for b in trainer.model.layers.values())
    assert compiled == pytest.approx(plain, rel=1e-5)


def test_compile_keeps_the_losses_of_a_mixture_of_experts(corpus, tmp_path):
    """The CPU's expert loop reads the group sizes on the host: the MoE block compiles with a graph break there
    (a fullgraph compile failed at step 1), and the loop runs eagerly: compiled, each new set of group sizes
    recompiled the block (nine times in three steps, 2.4x the test's time)."""
    import torch._dynamo

    _, plain = run_losses(corpus, tmp_path, "olmoe-plain", model__name="olmoe")
    torch._dynamo.reset()  # the blocks other tests of this process compiled share the block's code
    with torch._dynamo.config.patch(error_on_recompile=True):
        trainer, compiled = run_losses(corpus, tmp_path, "olmoe-compiled", model__name="olmoe",
                                       parallel__compile="true")
    assert all(type(b).__name__ == "OptimizedModule" for b in trainer.model.layers.values())
    assert compiled == pytest.approx(plain, rel=1e-5)
