"""A mixture of experts under expert parallel, FSDP and tensor parallel computes one process's training run: real
torchrun processes on CPU with gloo, a tiny OLMoE (8 experts, top-2) with z-loss and bias balancing, every job
but one from the reference's seed checkpoint.

The same losses (the load-balancing and z-losses in them), the same routing (each layer's expert load, summed over
the step's ranks, equal exactly) and the same balancing statistics; a checkpoint saved under expert parallel
resumes on one process.
"""

from __future__ import annotations


import pytest

from maester.config import load_config
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.helpers import REPO, job_from_checkpoints, torchrun, train_seeded_reference

STEPS = 5
BASE = dict(model__name="olmoe", training__steps=STEPS, training__global_batch_size=8,
            training__micro_batch_size=2, checkpoint__interval=0, checkpoint__save_final="false",
            schedule__warmup_steps=1,
            model__overrides='{"moe": {"z_loss_coef": 0.001, "bias_balancing": 0.001}}')

LAYOUTS = {
    # ep 2 over dp_shard 2: the experts split, dense weights FSDP; checkpoints at step 3 for the resume test
    "ep2": (2, {"parallel__ep": 2, "checkpoint__interval": 3}),
    "ep2_compile": (2, {"parallel__ep": 2, "parallel__compile": "true"}),  # the MoE blocks with graph breaks
    "ep2_fsdp4": (4, {"parallel__ep": 2}),  # experts FSDP-sharded over dp_shard / ep = 2 as well
    # experts replicated over 2 groups, every block recomputed in backward (its all-to-alls too)
    "ep2_hsdp2x2_full_ac": (4, {"parallel__ep": 2, "parallel__dp_replicate": 2,
                                "parallel__activation_checkpointing": "full"}),
    "tp2": (2, {"parallel__tp": 2, "parallel__dp_shard": 1}),
    "fsdp2_tp2": (4, {"parallel__tp": 2}),  # the tp-split experts and the replicated router FSDP-sharded too
    # experts split by expert over ep and by hidden unit over tp; checkpoints at step 3 for the resume test
    "ep2_tp2": (4, {"parallel__ep": 2, "parallel__tp": 2, "checkpoint__interval": 3}),
}
NO_SEED = {"ep2_hsdp2x2_full_ac"}  # initialised sharded, as one process initialises (the CPU init), not from the seed


def records(job_dir) -> list[dict]:
    return read_metrics(job_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, from the seed checkpoint every job copies."""
    root = tmp_path_factory.mktemp("moe_layouts")
    corpus, seed, job = train_seeded_reference(root, **BASE)
    return root, corpus, seed, records(job)


def prepare_job(root, corpus, checkpoints, name, **extra):
    return job_from_checkpoints(root, corpus, checkpoints, name, **{**BASE, **extra})


def assert_same_run(got: list[dict], expected: list[dict], steps=range(1, STEPS + 1)):
    got, expected = {r["step"]: r for r in got}, {r["step"]: r for r in expected}
    assert sorted(got) == list(steps)
    moe_keys = [k for k in expected[STEPS] if k.startswith("moe/")]
    assert len(moe_keys) == 10  # two layers: load min, max, entropy; balance and z-loss
    for step in steps:
        a, b = got[step], expected[step]
        for key in ("loss", "grad_norm"):  # the norm shows a gradient's scale, which Adam's update hides
            assert a[key] == pytest.approx(b[key], rel=1e-5), (step, key, a[key], b[key])
        for key in moe_keys:
            if "/load_" in key:  # from the integer expert loads of the whole step: equal routing, equal values
                assert a[key] == b[key], (step, key, a[key], b[key])
            else:
                assert a[key] == pytest.approx(b[key], rel=1e-5), (step, key, a[key], b[key])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_one_process(reference, layout):
    """The layout's run equals the reference; step 3's checkpoint of the ep2 run (experts as DTensors split over two
    ranks) and of the ep2_tp2 run (split by expert and by hidden unit) loads into one process, which continues the
    reference's losses and routing (in the same test: a test of its own could run in another pytest worker)."""
    root, corpus, seed, expected = reference
    job = prepare_job(root, corpus, None if layout in NO_SEED else seed, layout, **LAYOUTS[layout][1])
    run = torchrun(LAYOUTS[layout][0], ["train", str(job)], root)
    assert run.returncode == 0, run.stderr[-4000:]
    assert_same_run(records(job), expected)
    if "checkpoint__interval" in LAYOUTS[layout][1]:
        one = prepare_job(root, corpus, job / "checkpoints", f"{layout}_then_one")
        Trainer(load_config(one / "config.json", [], environ={}), one).train()
        assert_same_run([r for r in records(one) if r["step"] > 3], expected, steps=range(4, STEPS + 1))


def test_expert_parallel_layer_equals_one_process(tmp_path):
    """One MoE layer split over ep 2 x tp 2 (experts by expert and by hidden unit) against one process with both ep
    ranks' tokens: outputs and gradients, with routing spread over the experts and with every token sent to one ep
    rank (the other receives none). The script runs ep 2 alone on 2 processes; the ep2 layouts cover that here."""
    passed = tmp_path / "passed"
    out = torchrun(4, [str(passed)], tmp_path, timeout=180,
                   script=REPO / "tests" / "distributed" / "expert_parallel_layer.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert passed.read_text() == "passed"
