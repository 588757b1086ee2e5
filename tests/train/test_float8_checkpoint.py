"""Checkpoints of a float8 run under FSDP2's float8 all-gather (torchao's weight wrapper subclass), written in the
background and synchronously: the third GPU review's reproductions A1-A3 and A5, on one process (`force_fsdp`).

- the stager the background saves use copies every tensor bit for bit (A1: it copied the wrapper as uninitialised
  memory);
- a resume from the background (interval) checkpoint with float8 takes the run's own next losses (A2: NaN);
- in a fresh process that never imports torchao, a run without float8 resumes from it, and `convert to-hf`,
  `generate` and `eval` read the synchronous final checkpoint and the background one (A3: garbage weights; A5: the
  final checkpoint pickled torchao's class, refused as damaged).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from maester.config import load_config
from maester.train.metrics_file import read_metrics
from tests.helpers import REPO, clean_env, job_from_checkpoints, run_python, tiny_overrides, write_corpus

pytest.importorskip("torchao", reason="the float8 extra (torchao) is part of the dev group")

FLOAT8 = dict(training__float8__enabled="true", training__float8__emulate="true", training__precision="bf16")
RUN = dict(training__steps=3, checkpoint__interval=2, checkpoint__keep_last=3)


@pytest.fixture(scope="module")
def float8_run(tmp_path_factory):
    """A float8 FSDP run of 3 steps saving step 2 in the background and step 3 synchronously: (its trainer, job
    directory, losses, corpus)."""
    from maester.train.trainer import Trainer

    root = tmp_path_factory.mktemp("float8-checkpoints")
    corpus = write_corpus(root / "corpus.parquet")
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "float8", parallel__force_fsdp="true",
                                           checkpoint__async_mode="async", **FLOAT8, **RUN), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    trainer.train()
    events = (cfg.job_dir / "events.jsonl").read_text()
    assert '"checkpoint": "step-2", "background": true' in events
    return trainer, cfg.job_dir, [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")], corpus


def test_staged_float8_weights_equal_the_live_ones(float8_run):
    """Every tensor the background save stages equals the live one bit for bit, float8 weights included."""
    from torch.distributed.tensor import DTensor

    from maester.train.checkpoint_tensors import state_to_save
    from tests.train.staging import assert_staged_equals_live

    trainer = float8_run[0]
    wrapped = [p for p in trainer.model.parameters() if isinstance(p, DTensor)
               and type(p._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"]
    assert len(wrapped) == 14  # every linear of the 2 blocks: the case under test is there
    state = state_to_save(trainer.model, trainer.optimizer)
    assert_staged_equals_live(trainer.checkpointer._stage(state), trainer.model, trainer.optimizer)
    trainer.checkpointer.close()


def test_resume_with_float8_from_the_background_checkpoint(float8_run, tmp_path):
    from maester.cli import main

    _, job, losses, corpus = float8_run
    again = job_from_checkpoints(tmp_path, corpus, without_final(job, tmp_path), "again",
                                 parallel__force_fsdp="true", **FLOAT8, **RUN)
    main(["train", str(again)])
    assert read_metrics(again / "metrics.jsonl")[-1]["loss"] == losses[2]  # exact resume: the run's own step 3


def test_a_process_without_torchao_resumes_exports_generates_and_evaluates(float8_run, tmp_path):
    """Without float8, on one process without FSDP, from the background checkpoint: the run's step 3 to float8's
    rounding; then the commands that read checkpoints, on both checkpoints."""
    _, job, losses, corpus = float8_run
    resumed = job_from_checkpoints(tmp_path, corpus, without_final(job, tmp_path), "resumed",
                                   training__precision="bf16", **RUN)
    final = job / "checkpoints" / "step-3"
    commands = [["convert", "to-hf", final, tmp_path / "hf-final"], ["train", resumed],
                ["convert", "to-hf", job / "checkpoints" / "step-2", tmp_path / "hf-background"],
                ["generate", final, "--prompt", "the model", "--max-new-tokens", "4", "--temperature", "0",
                 "--device", "cpu"],
                ["eval", final, "--tasks", "pydoc_choice", "--limit", "2", "--device", "cpu"]]
    # a new process (a fork of one that imported torch and maester, never torchao: the script checks)
    out = run_python([json.dumps([[str(a) for a in c] for c in commands])], tmp_path, timeout=600,
                     script=REPO / "tests/train/commands_without_torchao.py",
                     env=clean_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home")))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok: maester") == len(commands)
    step3 = read_metrics(resumed / "metrics.jsonl")[-1]["loss"]
    assert math.isfinite(step3) and abs(step3 - losses[2]) < 0.02 * losses[2]
    for name in ("hf-final", "hf-background"):
        linears = [w for k, w in hf_weights(tmp_path / name).items() if "proj" in k]
        assert len(linears) == 14 and max(w.abs().max().item() for w in linears) < 1.0  # not stray memory


def without_final(job, tmp_path):
    """A copy of the job's checkpoints without the final one, as a run that crashed after step 2 leaves them."""
    copy = tmp_path / "crashed-checkpoints"
    shutil.copytree(job / "checkpoints", copy, symlinks=True)
    shutil.rmtree(copy / "step-3")
    (copy / "latest").unlink()
    return copy


def hf_weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
