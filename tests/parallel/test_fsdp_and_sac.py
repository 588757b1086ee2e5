"""FSDP's root keeps its parameters after forward (F13); selective checkpointing keeps biased matmuls (F17)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from maester.config import load_config
from maester.parallel.parallelize import _saved_ops, apply_fsdp


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("setting, pipelined, reshard", [
    ("true", False, True), ("false", False, False),
    ("null", False, True),   # the default: full shard
    ("null", True, False),   # N7: under PP each micro-batch's forward would gather every block again
    ("true", True, True),    # an explicit setting wins
])
def test_root_is_not_resharded_after_forward(one_rank_group, setting, pipelined, reshard):
    from torch.distributed.device_mesh import init_device_mesh

    from maester.models.build import build_on_meta, materialize, resolve_args

    cfg = load_config(None, ["--model.flavor=tiny", f"--parallel.fsdp_reshard_after_forward={setting}",
                             "--training.device=cpu"], environ={})
    model = build_on_meta(cfg.model, resolve_args(cfg.model, 256, cfg.mup))
    apply_fsdp(model, init_device_mesh("cpu", (1,)), cfg.parallel, torch.device("cpu"), pipelined=pipelined)
    model = materialize(model, torch.device("cpu"), 0)
    model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None]).sum().backward()

    def post_forward(module):
        return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info

    assert post_forward(model) is None  # the root: embeddings, norm and output stay gathered for backward
    blocks = list(model.layers.values())
    assert post_forward(blocks[-1]) is None  # backward needs the last block at once
    assert (post_forward(blocks[0]) is not None) == reshard


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_keeps_biased_linears():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from functools import partial

    from maester.parallel.parallelize import _selective_policy

    assert {torch.ops.aten.addmm.default, torch.ops.aten.linear.default} <= _saved_ops()
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=True), torch.nn.GELU(), torch.nn.Linear(16, 4))
    wrapped = checkpoint_wrapper(layer, preserve_rng_state=False,
                                 context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
    x = torch.randn(8, 16, requires_grad=True)
    with CountOps() as ops:
        wrapped(x).sum().backward()
    # two biased linears in forward, none run again in backward (which uses mm for the gradients)
    assert ops.counts.get(torch.ops.aten.addmm.default) == 2


def test_selective_checkpointing_keeps_the_context_parallel_gather(one_rank_group):
    """N15: each layer's K/V all-gather under context parallel runs once, in forward; backward does not gather
    again (1-rank cp group on gloo). Also in the saved ops: the grouped GEMM of a mixture of experts."""
    from torch.distributed.device_mesh import init_device_mesh

    from maester.models.build import build_model
    from maester.parallel.context_parallel import apply_context_parallel
    from maester.parallel.parallelize import apply_activation_checkpointing

    assert torch.ops.aten._grouped_mm.default in _saved_ops()
    cfg = load_config(None, ["--model.flavor=tiny", "--training.device=cpu"], environ={})
    model = build_model(cfg.model, 256, torch.device("cpu"), seed=0)
    apply_context_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)))
    apply_activation_checkpointing(model, "selective-op", 1)
    tokens, positions = torch.randint(0, 256, (2, 16)), torch.arange(16).expand(2, 16)
    gather = torch.ops.maester.cp_all_gather.default
    with CountOps() as forward:
        loss = model(tokens, positions, labels=tokens)
    with CountOps() as backward:
        loss.backward()
    assert forward.counts.get(gather) == model.args.n_layers
    assert gather not in backward.counts
