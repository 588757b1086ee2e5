"""Muon steps a sharded or replicated model exactly as one process steps the whole matrices: gloo processes on
CPU, each comparing its parallel model, stepped three times with given gradients, with the single-process
reference (`reference_muon_step`, and torch's AdamW for the 1-D parameter). Also: each matrix is
orthogonalised by one rank only, and a DCP save and load under FSDP2 continues bit-identically."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests import forkserver

# Each matrix's row counts: a fused projection of three logical matrices, and two plain ones.
EVEN = {"qkv": ((8, 4, 4), 8), "up": ((12,), 8), "down": ((8,), 12)}
UNEVEN = {"qkv": ((5, 3, 3), 8), "up": ((7,), 8), "down": ((8,), 7)}  # 11 and 7 rows: uneven FSDP shards

SETTINGS = [
    ({}, "quintic"),
    ({"normuon": True, "nesterov": False, "lr_scaling": "match_adamw", "momentum_warmup_steps": 2,
      "weight_decay": 0.1}, "polar_express"),
]
LR = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Toy(nn.Module):
    def __init__(self, shapes: dict):
        super().__init__()
        for name, (rows, cols) in shapes.items():
            setattr(self, name, nn.Linear(cols, sum(rows), bias=False))
        self.norm = nn.Parameter(torch.ones(8))


def _toy(shapes: dict) -> Toy:
    torch.manual_seed(0)
    return Toy(shapes)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grad(name: str, shape, step: int) -> torch.Tensor:
    """The same full gradient on every rank (DDP and FSDP would have averaged theirs to this)."""
    seed = 100 * step + sum(map(ord, name))
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _set_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        g = _grad(name, p.shape, step)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) \
            else g


def _optimizer(model: nn.Module, shapes: dict, kwargs: dict, coefficients: str):
    from maester.train.muon import Muon

    matrices = [getattr(model, name).weight for name in shapes]
    splits = {getattr(model, name).weight: rows for name, (rows, _) in shapes.items() if len(rows) > 1}
    return Muon([{"params": matrices, "muon": True}, {"params": [model.norm], "muon": False, "weight_decay": 0.0}],
                lr=LR, coefficients=coefficients, splits=splits, **kwargs)


def _parallelize(model: nn.Module, layout: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_plan = {"qkv": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout in ("fsdp", "fsdp-uneven"):
        fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    elif layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    elif layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), tp_plan)
    elif layout == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        fully_shard(model, mesh=mesh["dp_shard"])
    elif layout != "ddp":  # ddp: plain tensors, every rank a whole copy
        raise ValueError(layout)


def _check_against_reference(layout: str, world: int) -> None:
    import maester.train.muon as muon
    from tests.train.muon_reference import reference_muon_step

    shapes = UNEVEN if layout == "fsdp-uneven" else EVEN
    calls = {"n": 0}
    newton_schulz = muon.newton_schulz

    def counting(*args, **kwargs):
        calls["n"] += 1
        return newton_schulz(*args, **kwargs)

    for kwargs, coefficients in SETTINGS:
        reference = _toy(shapes)
        model = _toy(shapes)
        _parallelize(model, layout, world)
        opt = _optimizer(model, shapes, kwargs, coefficients)
        ref_states = {name: {} for name in shapes}
        ref_adamw = torch.optim.AdamW([reference.norm], lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        gathers = []  # object all-gathers (each a gloo round trip): the layouts of every matrix, found once
        all_gather_object = torch.distributed.all_gather_object

        def counting_gathers(*args, **kwargs):
            gathers.append(step)
            return all_gather_object(*args, **kwargs)

        for step in range(3):
            _set_grads(model, step)
            muon.newton_schulz, calls["n"] = counting, 0
            torch.distributed.all_gather_object = counting_gathers
            try:
                opt.step()
            finally:
                muon.newton_schulz = newton_schulz
                torch.distributed.all_gather_object = all_gather_object
            # Each logical matrix is orthogonalised once in the whole group, not once per rank, and not all by
            # the same rank.
            total, most = torch.tensor(calls["n"]), torch.tensor(calls["n"])
            torch.distributed.all_reduce(total)
            torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
            assert total.item() == sum(len(rows) for rows, _ in shapes.values()), (layout, total.item())
            assert most.item() < total.item(), (layout, most.item())
            # F20: all of a step's matrices share one process group here, so one gather, on the first step only
            # (one per matrix before).
            assert gathers == [0], (layout, gathers)
            for name, (rows, _) in shapes.items():
                w = getattr(reference, name).weight.data
                reference_muon_step(w, _grad(f"{name}.weight", w.shape, step), ref_states[name], lr=LR,
                                    coefficients=coefficients, split=rows, **kwargs)
            reference.norm.grad = _grad("norm", (8,), step)
            ref_adamw.step()
            expected = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                torch.testing.assert_close(_full(p.data), expected[name].data, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{layout} {kwargs} step {step} {name}: {m}")
        for name in shapes:
            state = opt.state[getattr(model, name).weight]
            torch.testing.assert_close(_full(state["momentum_buffer"]), ref_states[name]["momentum_buffer"],
                                       rtol=1e-6, atol=1e-6)
            if "normuon_v" in ref_states[name]:
                torch.testing.assert_close(state["normuon_v"], ref_states[name]["normuon_v"], rtol=1e-5, atol=1e-9)


def _check_dcp_round_trip(world: int, directory: str) -> None:
    """Save after two steps, load into a fresh model and optimizer, and take two more steps on both."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    kwargs, coefficients = SETTINGS[1]
    shapes = UNEVEN
    model = _toy(shapes)
    _parallelize(model, "fsdp", world)
    opt = _optimizer(model, shapes, kwargs, coefficients)
    for step in range(2):
        _set_grads(model, step)
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)

    fresh = Toy(shapes)  # other weights: the checkpoint must bring them
    _parallelize(fresh, "fsdp", world)
    fresh_opt = _optimizer(fresh, shapes, kwargs, coefficients)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for step in range(2, 4):
        for m, o in ((model, opt), (fresh, fresh_opt)):
            _set_grads(m, step)
            o.step()
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name


def _worker(rank: int, world: int, port: int, layout: str, directory: str, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if layout == "dcp":
            _check_dcp_round_trip(world, directory)
        else:
            _check_against_reference(layout, world)
    except BaseException as e:  # report to the parent: a failing assert in a child is otherwise only printed
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        torch.distributed.destroy_process_group()


def _run(layout: str, world: int, directory: str = "") -> None:
    # forked from a server that imported torch, FSDP and maester once: importing them takes longer than the checks
    ctx = forkserver.context()
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), layout, directory, errors), nprocs=world, join=True,
                       start_method="forkserver")
    assert errors.empty(), errors.get()


@pytest.mark.parametrize("layout, world", [
    ("fsdp", 2), ("fsdp-uneven", 2), ("ddp", 2), ("tp", 2), ("hsdp", 4), ("fsdp+tp", 4),
])
def test_muon_in_a_parallel_layout_equals_one_process(layout, world):
    _run(layout, world)


def test_dcp_round_trip_under_fsdp_continues_identically(tmp_path):
    _run("dcp", 2, str(tmp_path / "checkpoint"))
