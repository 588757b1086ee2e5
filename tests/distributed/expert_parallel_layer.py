"""Run under torchrun with 2 processes (gloo, CPU): one MoE layer with its experts split over the two ranks
(`apply_expert_parallel`), each rank with its own tokens, against the same layer on one process with all the
tokens: outputs, input gradients, the experts' gradients (this rank's experts) and the router's (summed over the
ranks). Twice: routing spread over all experts, and skewed so that every token goes to rank 0's experts (rank 1
receives none). The split layer's forward and backward run no op that would wait for the GPU but the one read of
the all-to-all's splits (a `tolist`, not an op). Raises on a mismatch; rank 0 writes argv[1] when all passed."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from maester.models.args import MoEArgs
from maester.models.moe import MoEFeedForward
from maester.parallel.expert_parallel import apply_expert_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.helpers import DeviceReads  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
torch.set_num_threads(1)

for case in ("spread", "skewed"):
    torch.manual_seed(0)
    args = MoEArgs(n_experts=8, top_k=2, expert_hidden_dim=16, n_shared_experts=1, bias_balancing=0.01)
    one = MoEFeedForward(16, args, "silu")
    for p in one.parameters():
        torch.nn.init.normal_(p, std=0.3)
    one.reset_state()
    if case == "skewed":  # only experts 0-3 (rank 0's) can win the top-2
        one.router.expert_bias[4:] = -100.0
    x_all = torch.randn(2 * 12, 16, requires_grad=True)
    grad_all = torch.randn(2 * 12, 16)
    ep = copy.deepcopy(one)
    apply_expert_parallel(ep, mesh)

    expected = one(x_all)
    (expected * grad_all).sum().backward()
    rows = slice(rank * 12, (rank + 1) * 12)
    x = x_all.detach()[rows].clone().requires_grad_()
    with DeviceReads() as reads:
        out = ep(x)
        (out * grad_all[rows]).sum().backward()
    assert reads.calls == [], (case, reads.calls)

    gate_proj = ep.experts.gate_proj
    assert isinstance(gate_proj, DTensor) and gate_proj.to_local().shape[0] == 8 // world, case
    torch.testing.assert_close(out, expected[rows], msg=lambda m: f"{case} output: {m}")
    torch.testing.assert_close(x.grad, x_all.grad[rows], msg=lambda m: f"{case} input grad: {m}")
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for name in ("gate_proj", "up_proj", "down_proj"):
        got = getattr(ep.experts, name).grad.to_local()
        torch.testing.assert_close(got, getattr(one.experts, name).grad[mine], msg=lambda m: f"{case} {name}: {m}")
    router = ep.router.gate.weight.grad.clone()
    dist.all_reduce(router)
    torch.testing.assert_close(router, one.router.gate.weight.grad, msg=lambda m: f"{case} router: {m}")
    load = ep.load.clone()
    dist.all_reduce(load)
    assert torch.equal(load, one.load), (case, load, one.load)
    if case == "skewed":
        assert load[4:].sum() == 0 and load.sum() == 2 * 24

if rank == 0:
    Path(sys.argv[1]).write_text("passed")
dist.barrier()  # both ranks done before either tears the group down
dist.destroy_process_group()
# Leave without the interpreter's teardown, where a C++ thread of the group left joinable now and then aborts a
# process that passed (as test_tp_architectures does).
os._exit(0)
