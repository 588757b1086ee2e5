"""Every parallel layout computes the same training run: real torchrun processes on CPU with gloo.

Each job starts from the same seed checkpoint, so the only difference between runs is the layout; one layout
(FSDP x TP) starts without it, to show that sharded CPU init equals one process's init.
"""

from __future__ import annotations


import pytest

from maester.train.metrics import read_metrics
from tests.helpers import job_from_checkpoints, torchrun, train_seeded_reference

STEPS = 5
BASE = dict(training__steps=STEPS, training__global_batch_size=8, training__micro_batch_size=2,
            checkpoint__interval=0, checkpoint__save_final="false", schedule__warmup_steps=1)

LAYOUTS = {
    "fsdp2": (2, {}),
    "fsdp4": (4, {}),
    "shard_grad_op2": (2, {"parallel__fsdp_reshard_after_forward": "false"}),
    "hsdp2x2": (4, {"parallel__dp_replicate": 2}),
    "ddp2": (2, {"parallel__dp_replicate": 2, "parallel__dp_shard": 1}),
    "tp2": (2, {"parallel__tp": 2, "parallel__dp_shard": 1}),
    "fsdp2_tp2": (4, {"parallel__tp": 2}),
    "fsdp2_selective_ac": (2, {"parallel__activation_checkpointing": "selective-op"}),
}


def losses(job_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(job_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, from a seed checkpoint that every layout's job copies."""
    root = tmp_path_factory.mktemp("layouts")
    corpus, seed, job = train_seeded_reference(root, **BASE)
    return root, corpus, seed, losses(job)


NO_SEED = {"fsdp2_tp2"}


def prepare_job(root, corpus, seed, name, **extra):
    return job_from_checkpoints(root, corpus, None if name in NO_SEED else seed, name, **{**BASE, **extra})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(reference, layout):
    root, corpus, seed, expected = reference
    nproc, extra = LAYOUTS[layout]
    job = prepare_job(root, corpus, seed, layout, **extra)
    run = torchrun(nproc, ["train", str(job)], root)
    assert run.returncode == 0, run.stderr[-4000:]
    got = losses(job)
    assert len(got) == STEPS
    assert got == pytest.approx(expected, rel=1e-5), (layout, got, expected)



def test_fsdp_bfloat16_parameters_train_close_to_float32(reference):
    """precision = bf16 under FSDP: the mixed-precision policy computes in bf16 (so not bitwise fp32), close to
    the fp32 curve, reduce in fp32."""
    root, corpus, seed, expected = reference
    job = prepare_job(root, corpus, seed, "fsdp2_bf16", training__precision="bf16")
    run = torchrun(2, ["train", str(job)], root)
    assert run.returncode == 0, run.stderr[-4000:]
    got = losses(job)
    assert got == pytest.approx(expected, rel=2e-2)
    assert got != pytest.approx(expected, rel=1e-6)


def test_fsdp_fp16_with_loss_scaling_trains_close_to_float32(reference):
    """precision = fp16 on 2 FSDP ranks: the loss scale is shared (an overflow is read from the global gradient
    norm), logged on every step, and the curve stays close to fp32."""
    root, corpus, seed, expected = reference
    job = prepare_job(root, corpus, seed, "fsdp2_fp16", training__precision="fp16")
    run = torchrun(2, ["train", str(job)], root)
    assert run.returncode == 0, run.stderr[-4000:]
    records = read_metrics(job / "metrics.jsonl")
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=2e-2)
    assert all(r["grad_scale"] == 2.0**16 for r in records)
