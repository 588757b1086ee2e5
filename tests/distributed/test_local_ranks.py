"""Eight-rank layouts that a CPU machine cannot run as processes, simulated in one process with torch's
LocalTensorMode (`local_ranks`): HSDP 2 x 2 with two pipeline stages, and ep 2 x tp 2 with the experts
FSDP-sharded over 2 groups. Each computes one process's losses, gradient norms and gradients, 3 steps."""

from __future__ import annotations

import pytest
import torch

from maester.config import load_config
from tests.helpers import DEMO_CONFIG

pytest.importorskip("torch.distributed._local_tensor", reason="LocalTensorMode is not in this torch")

from tests.distributed.local_ranks import train_one_process, train_simulated  # noqa: E402

STEPS = 3
BASE = {"model.flavor": "tiny", "data.seq_len": "16", "training.micro_batch_size": "1", "training.device": "cpu",
        "training.precision": "fp32", "optimizer.lr": "3e-3"}
LAYOUTS = {
    # 2 replicas x 2 shards per stage, 2 stages; 2 micro-batches per rank fill the pipeline
    "hsdp2x2_pp2": {"parallel.dp_replicate": "2", "parallel.dp_shard": "2", "parallel.pp": "2",
                    "training.global_batch_size": "8"},
    # experts split over ep 2 and by hidden unit over tp 2, FSDP-sharded over dp_shard / ep = 2 groups
    # (one MoE block, the byte vocabulary: the simulation runs each op once per rank)
    "ep2_tp2_fsdp4": {"model.name": "olmoe", "model.overrides": '{"vocab_size": 256, "n_layers": 1}',
                      "parallel.ep": "2", "parallel.tp": "2", "parallel.dp_shard": "4",
                      "training.global_batch_size": "4"},
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_eight_simulated_ranks_compute_one_process(layout):
    cfg = load_config(DEMO_CONFIG, [f"--{k}={v}" for k, v in {**BASE, **LAYOUTS[layout]}.items()], environ={})
    simulated = train_simulated(cfg, 8, STEPS)
    reference = train_one_process(cfg, STEPS, dp=4)
    assert len(simulated.losses) == STEPS
    torch.testing.assert_close(simulated.losses, reference.losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(simulated.grad_norms, reference.grad_norms, rtol=1e-5, atol=0)
    assert simulated.gradients.keys() == reference.gradients.keys()
    for name, grad in reference.gradients.items():
        torch.testing.assert_close(simulated.gradients[name], grad, rtol=1e-4, atol=1e-7, msg=name)
