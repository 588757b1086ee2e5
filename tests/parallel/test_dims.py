"""Impossible layouts are refused before any work, with a message that says what to change."""

from __future__ import annotations

import pytest

from maester.config import load_config
from maester.parallel.dims import ParallelDims
from tests.helpers import REPO


def dims(world, *overrides, flavor="tiny"):
    cfg = load_config(None, [f"--model.flavor={flavor}", "--data.seq_len=32", *overrides], environ={})
    return ParallelDims.from_config(cfg, world)


def test_dp_shard_takes_the_remaining_ranks():
    d = dims(8, "--parallel.dp_replicate=2", "--parallel.tp=2", "--training.global_batch_size=16",
             "--training.micro_batch_size=2")
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp_size) == (2, 2, 2, 4)
    assert d.fsdp_enabled and not d.ddp_enabled
    assert dims(2, "--parallel.tp=2", "--model.overrides.tie_embeddings=true").tp == 2  # tied heads take TP
    assert dims(2, "--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.micro_batch_size=2",
                "--training.global_batch_size=4").ddp_enabled


@pytest.mark.parametrize("world, overrides, message", [
    (4, ["--parallel.tp=3"], "does not divide the 4 process(es)"),
    (4, ["--parallel.dp_shard=2"], "= 2 processes, but 4 were launched"),
    (8, ["--parallel.tp=8"], "does not divide the model's n_heads (4)"),
    (4, ["--parallel.tp=4"], "does not divide the model's n_kv_heads (2)"),
    (2, ["--parallel.tp=2", "--data.seq_len=33"], "does not divide data.seq_len = 33"),
    (4, ["--parallel.tp=2", "--parallel.dp_replicate=2", "--parallel.dp_shard=1"], "DDP"),
    (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.param_dtype=bfloat16"],
     "parallel.param_dtype applies to FSDP only"),
    (1, ["--parallel.cpu_offload=true", "--training.device=cuda"], "parallel.cpu_offload applies to FSDP only"),
    (2, ["--parallel.cpu_offload=true", "--training.device=cpu"], "this run is on the CPU already"),
    (4, ["--training.global_batch_size=8", "--training.micro_batch_size=4"],
     "make training.global_batch_size a multiple of 16 sequences"),
    (4, ["--parallel.cp=2", "--data.seq_len=30"], "divisible by 2 x cp = 4"),
    (2, ["--parallel.cp=2", "--model.name=olmoe", "--training.global_batch_size=2", "--training.micro_batch_size=1"],
     "with a mixture of experts"),
    (2, ["--parallel.cp=2", "--model.attention=varlen"], "cannot use model.attention = 'varlen'"),
    (2, ["--parallel.pp=2", "--model.overrides.n_layers=1"], "makes 2 pipeline stages, which need at least as many"),
    (2, ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B", "--model.overrides.n_layers=3"],
     "makes 4 pipeline stages, which need at least as many layers, but the model has n_layers = 3"),
    (2, ["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble", "--parallel.pp_layers=[1,1]"],
     "needs one per stage, 2 x pp of them"),
    (2, ["--parallel.pp=2", "--parallel.pp_layers=[1,2]"], "sum to the model's n_layers = 2"),
    (2, ["--parallel.pp=2", "--parallel.pp_layers=[2,0]"], "at least one layer"),
    (1, ["--parallel.pp_layers=[2]"], "but parallel.pp = 1"),
    (2, ["--parallel.pp=2", "--training.global_batch_size=2", "--training.micro_batch_size=2"],
     "needs at least 2 micro-batches per step on each rank"),
    (2, ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B", "--model.overrides.n_layers=4",
         "--training.global_batch_size=10", "--training.micro_batch_size=2"],
     "5 micro-batches per step do not split into 2 rounds"),
    (2, ["--parallel.pp=2", "--model.overrides.tie_embeddings=true"], "does not support tied embeddings"),
    (2, ["--parallel.pp=2", "--model.name=olmoe"], "does not support a mixture-of-experts model"),
    (4, ["--parallel.pp=2", "--parallel.dp_replicate=2", "--parallel.dp_shard=1",
         "--training.global_batch_size=8", "--training.micro_batch_size=2"], "does not support DDP"),
    (2, ["--parallel.ep=2"], "is a dense model"),
    (4, ["--parallel.ep=3", "--model.name=olmoe"], "does not divide the model's moe.n_experts (8)"),
    (2, ["--parallel.ep=4", "--model.name=olmoe"], "must divide parallel.dp_shard = 2"),
    (4, ["--parallel.ep=2", "--parallel.pp=2", "--model.name=olmoe"], "parallel.ep = 2 with parallel.pp = 2 is not"),
    (2, ["--parallel.tp=2", "--parallel.dp_shard=1", "--model.name=olmoe",
         "--model.overrides.moe.expert_hidden_dim=33"],
     "parallel.tp = 2 does not divide the model's moe.expert_hidden_dim (33)"),
    (2, ["--parallel.ep=2", "--parallel.activation_checkpointing=selective-op", "--model.name=olmoe"],
     'set parallel.activation_checkpointing = "full"'),
])
def test_bad_layouts(world, overrides, message):
    with pytest.raises(ValueError) as info:
        dims(world, *overrides)
    assert message in str(info.value)


def test_ep_composes_with_tp():
    """ep borrows dp_shard ranks, tp has its own: 4 processes hold dp_shard 2 (ep 2) x tp 2."""
    d = dims(4, "--parallel.ep=2", "--parallel.tp=2", "--model.name=olmoe")
    assert (d.dp_shard, d.ep, d.tp) == (2, 2, 2)


def test_cp_and_pp_take_their_ranks_from_the_world():
    d = dims(8, "--parallel.cp=2", "--parallel.tp=2", "--training.global_batch_size=8",
             "--training.micro_batch_size=2")
    assert (d.cp, d.tp, d.dp_shard, d.dp_size) == (2, 2, 2, 2)
    assert d.fsdp_enabled  # the cp ranks shard the weights too
    d = dims(8, "--parallel.pp=2", "--training.global_batch_size=16", "--training.micro_batch_size=2")
    assert (d.pp, d.dp_shard, d.dp_size) == (2, 4, 4)
    with pytest.raises(ValueError, match="parallel.cp = 2 with parallel.pp = 2 is not supported yet"):
        dims(8, "--parallel.pp=2", "--parallel.cp=2", "--training.global_batch_size=8",
             "--training.micro_batch_size=2")


def test_the_olmoe_config_lays_out_on_two_nodes_of_eight():
    """configs/olmoe/1b-7b.toml: FSDP over 16 ranks with the experts split over the 8 of a node, 8 experts each,
    and FSDP-sharded over the 2 nodes; on fewer ranks than ep it says what to change."""
    cfg = load_config(REPO / "configs" / "olmoe" / "1b-7b.toml", environ={})
    d = ParallelDims.from_config(cfg, 16)
    assert (d.dp_shard, d.ep, d.dp_size, d.dp_shard // d.ep) == (16, 8, 16, 2)
    assert cfg.model.architecture().moe.n_experts // d.ep == 8
    assert d.batch_plan(cfg, dp_rank=0).accumulation_steps == 16  # 1024 sequences of 4 per rank and micro-batch
    with pytest.raises(ValueError, match="must divide parallel.dp_shard = 4"):
        ParallelDims.from_config(cfg, 4)


def test_zbv_on_the_cpu_is_refused_where_torch_would_send_a_rank_to_itself():
    """torch 2.10's schedules open their links with a send to each neighbour stage, the same rank's too (the V's
    middle stages): gloo cannot, so that torch refuses ZBV on the CPU up front; newer torch trains it."""
    from maester.parallel.pipeline import v_schedule_sends_to_itself

    layout = ("--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble", "--model.overrides.n_layers=4",
              "--training.device=cpu", "--training.global_batch_size=8", "--training.micro_batch_size=2")
    if v_schedule_sends_to_itself():
        with pytest.raises(ValueError, match="gloo cannot do"):
            dims(2, *layout)
    else:
        assert dims(2, *layout).pp == 2


@pytest.mark.parametrize("schedule, layers, ok", [
    ("1F1B", [2, 2], True), ("1F1B", [1, 1, 1, 1], False), ("GPipe", [3, 1], True),
    ("Interleaved1F1B", [1, 1, 1, 1], True), ("Interleaved1F1B", [1, 1, 1, 1, 1, 1], True),
    ("Interleaved1F1B", [2, 2], False), ("Interleaved1F1B", [1, 1, 1, 1, 2], False),
    ("ZBVZeroBubble", [1, 1, 1, 1], True), ("ZBVZeroBubble", [1, 1, 1, 1, 1, 1], False),
])
def test_pp_layers_needs_one_entry_per_stage_of_the_schedule(schedule, layers, ok):
    layout = (f"--parallel.pp_schedule={schedule}", f"--parallel.pp_layers={layers}".replace(" ", ""),
              f"--model.overrides.n_layers={sum(layers)}", "--training.global_batch_size=8",
              "--training.micro_batch_size=2", "--training.device=cuda")  # cuda: no torch-specific ZBV refusal
    if ok:
        assert dims(2, "--parallel.pp=2", *layout).pp == 2
    else:
        with pytest.raises(ValueError, match="needs one per stage"):
            dims(2, "--parallel.pp=2", *layout)


@pytest.fixture
def fake_world():
    """16 ranks in one process (torch's fake process group): the meshes of a real layout, no traffic."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    yield
    dist.destroy_process_group()


def test_flattened_views_are_kept_not_sliced_from_the_root(fake_world):
    """F20: the flattened views (and HSDP's 2-D mesh over one) are the meshes `_flatten` returned, not slices of a
    flattened name from the root, which torch deprecates; they hold the same ranks as those slices."""
    import warnings

    d = dims(16, "--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.tp=2", "--data.seq_len=32",
             "--training.global_batch_size=8", "--training.micro_batch_size=2")
    cases = [("dp",), ("dp_cp",), ("dp_shard",), ("dp_shard_cp",), ("dp_replicate", "dp_shard"),
             ("dp_replicate", "dp_shard_cp"), ("tp",)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meshes = {names: d.submesh(*names) for names in cases}
    assert not [w for w in caught if "flattened" in str(w.message)], [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for names, mesh in meshes.items():
            assert mesh.mesh_dim_names == names
            assert mesh.mesh.tolist() == d.mesh[names if len(names) > 1 else names[0]].mesh.tolist(), names
    assert d.dp_rank == meshes[("dp",)].get_local_rank()


def test_every_group_of_the_layout_gets_the_training_timeout(fake_world):
    """N12: DeviceMesh.get_all_groups leaves out the flattened views' groups (FSDP's dp_shard, the loss's dp_cp,
    ...), which then kept the long init timeout; `process_groups` has them."""
    d = dims(16, "--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.tp=2", "--data.seq_len=32",
             "--training.global_batch_size=8", "--training.micro_batch_size=2")
    groups = d.process_groups()
    flattened = [d.submesh(name).get_group() for name in ("dp", "dp_cp", "dp_shard", "dp_shard_cp")]
    assert all(any(g is f for g in groups) for f in flattened)
    assert not any(g is f for f in flattened for g in d.mesh.get_all_groups())  # the gap this closes
    assert len(groups) == len({id(g) for g in groups})


def test_set_collective_timeout_reaches_every_group_it_is_given():
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from maester.parallel.dims import set_collective_timeout

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(minutes=10))
    try:
        group = dist.new_group([0])
        set_collective_timeout(7, [group])
        for g in (group, dist.group.WORLD):
            assert g._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


def test_no_module_slices_a_flattened_dimension_from_the_root():
    """G11: `mesh["dp"]` (any name of `FLATTENED`) slices a flattened dimension from the root mesh, which torch
    deprecates; the package asks `ParallelDims.submesh`, which keeps the flattened meshes."""
    import ast
    from pathlib import Path

    import maester
    from maester.parallel.dims import FLATTENED

    found = []
    for path in sorted(Path(maester.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "mesh":
                keys = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                if any(isinstance(k, ast.Constant) and k.value in FLATTENED for k in keys):
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []
