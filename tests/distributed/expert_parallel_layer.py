"""Run under torchrun with 2 processes (gloo, CPU): one MoE layer with its experts split over the two ranks
(`apply_expert_parallel`), each rank with its own tokens, against the same layer on one process with all the
tokens: outputs, input gradients, the experts' gradients (gathered) and the router's (summed over the ranks).
Twice: routing spread over all experts, and skewed so that every token goes to ep rank 0's experts (ep rank 1
receives none). With 4 processes: ep 2 x tp 2, the experts' hidden units split over tp as well (the tp plan, then
expert parallel); the two tp ranks of an ep rank hold the same tokens. The split layer's forward and backward run no op
that would wait for the GPU but the one read of the all-to-all's splits (a `tolist`, not an op). Raises on a
mismatch; rank 0 writes argv[1] when all passed."""

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
from maester.parallel.expert_parallel import apply_expert_parallel, moe_tensor_parallel_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.helpers import DeviceReads  # noqa: E402

dist.init_process_group("gloo")
world = dist.get_world_size()
tp = 2 if world == 4 else 1  # 4 processes: ep 2 x tp 2, the tp plan applied first as parallelize does
mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("ep", "tp"))
rank = mesh["ep"].get_local_rank()  # the tp ranks of one ep rank hold the same tokens
world //= tp  # the ep ranks, each with its own tokens
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
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        block = torch.nn.Module()
        block.feed_forward = ep
        parallelize_module(block, mesh["tp"], moe_tensor_parallel_plan(ep, "feed_forward", sequence_parallel=False))
    apply_expert_parallel(ep, mesh if tp > 1 else mesh["ep"])

    expected = one(x_all)
    (expected * grad_all).sum().backward()
    rows = slice(rank * 12, (rank + 1) * 12)
    x = x_all.detach()[rows].clone().requires_grad_()
    with DeviceReads() as reads:
        out = ep(x)
        (out * grad_all[rows]).sum().backward()
    assert reads.calls == [], (case, reads.calls)

    gate_proj = ep.experts.gate_proj
    assert isinstance(gate_proj, DTensor) and gate_proj.to_local().shape[:2] == (8 // world, 16 // tp), case
    torch.testing.assert_close(out, expected[rows], msg=lambda m: f"{case} output: {m}")
    torch.testing.assert_close(x.grad, x_all.grad[rows], msg=lambda m: f"{case} input grad: {m}")
    for name in ("gate_proj", "up_proj", "down_proj"):  # each rank's experts saw every rank's tokens
        got = getattr(ep.experts, name).grad.full_tensor()
        torch.testing.assert_close(got, getattr(one.experts, name).grad, msg=lambda m: f"{case} {name}: {m}")
    router = ep.router.gate.weight.grad
    router = (router.to_local() if isinstance(router, DTensor) else router).clone()  # replicated over tp
    dist.all_reduce(router, group=mesh["ep"].get_group())
    torch.testing.assert_close(router, one.router.gate.weight.grad, msg=lambda m: f"{case} router: {m}")
    load = ep.load.clone()
    dist.all_reduce(load, group=mesh["ep"].get_group())
    assert torch.equal(load, one.load), (case, load, one.load)
    if case == "skewed":
        assert load[4:].sum() == 0 and load.sum() == 2 * 24

if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text("passed")
dist.barrier()  # every rank done before either tears the group down
dist.destroy_process_group()
# Leave without the interpreter's teardown, where a C++ thread of the group left joinable now and then aborts a
# process that passed (as test_tp_architectures does).
os._exit(0)
