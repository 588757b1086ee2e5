"""How the layers split into pipeline stages and which stages each pipeline rank runs."""

from __future__ import annotations

import pytest
import torch

from maester.config import ParallelConfig
from maester.models.build import build_on_meta, resolve_args
from maester.models.config import ModelConfig
from maester.parallel.pipeline import split_stage, stage_indices, stage_layer_counts


@pytest.mark.parametrize("overrides, n_layers, counts", [
    ({"pp": 2}, 4, [2, 2]),
    ({"pp": 2}, 5, [3, 2]),
    ({"pp": 2, "pp_schedule": "Interleaved1F1B"}, 6, [2, 2, 1, 1]),
    ({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 4, [1, 1, 1, 1]),
    ({"pp": 2, "pp_layers": [3, 1]}, 4, [3, 1]),
    ({"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_layers": [1, 2, 2, 1, 1, 1]}, 8, [1, 2, 2, 1, 1, 1]),
])
def test_stage_layer_counts(overrides, n_layers, counts):
    assert stage_layer_counts(n_layers, ParallelConfig(**overrides)) == counts


def test_stage_indices_loop_round_robin_and_v_pairs_first_with_last():
    assert [stage_indices(r, 2, 2, "1F1B") for r in range(2)] == [(0,), (1,)]
    assert [stage_indices(r, 2, 4, "Interleaved1F1B") for r in range(2)] == [(0, 2), (1, 3)]
    assert [stage_indices(r, 4, 8, "ZBVZeroBubble") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def test_stages_keep_the_whole_models_parameter_names():
    cfg = ModelConfig(name="llama", flavor="tiny", overrides={"n_layers": 4})
    whole = build_on_meta(cfg, resolve_args(cfg, 256))
    parts = [split_stage(whole, range(0, 1), True, False), split_stage(whole, range(1, 3), False, False),
             split_stage(whole, range(3, 4), False, True)]
    names = [set(dict(p.named_parameters())) for p in parts]
    assert set().union(*names) == set(dict(whole.named_parameters()))
    assert not names[0] & names[1] and not names[1] & names[2]
    assert "tok_embeddings.weight" in names[0] and {"norm.weight", "output.weight"} <= names[2]
    assert {n.split(".")[1] for n in names[1]} == {"1", "2"}
    # a stage computes from the previous stage's hidden states: sizes from position_ids, hidden states out
    middle = split_stage(build_on_meta(cfg, resolve_args(cfg, 256)), range(1, 3), False, False)
    middle.to_empty(device="cpu")
    middle.init_weights()
    h = torch.randn(2, 8, whole.args.dim)
    out = middle(h, torch.arange(8).expand(2, 8))
    assert out.shape == h.shape and not torch.equal(out, h)


def test_the_last_stage_computes_the_chunked_loss_not_the_logits():
    """N3 on PP's last stage: given the labels (every stage gets them), the stage returns the summed token loss of
    its logits, and its peak memory (MemTracker) is bounded by the loss's chunk, not by the micro-batch's
    tokens x vocabulary logits."""
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    import maester.models.loss as loss_module
    from maester.models.build import materialize

    cfg = ModelConfig(name="llama", flavor="tiny", attention="sdpa")
    args = resolve_args(cfg, 4096)
    whole = materialize(build_on_meta(cfg, args), torch.device("cpu"), seed=0)
    last = split_stage(whole, range(args.n_layers - 1, args.n_layers), first=False, last=True)
    batch, seq = 4, 256
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, args.dim, generator=g)  # the previous stage's output
    labels = torch.randint(0, 4096, (batch, seq), generator=g)
    positions = torch.arange(seq).expand(batch, seq)

    def peak(chunk_elements: int) -> tuple[torch.Tensor, int]:
        saved, loss_module.CHUNK_ELEMENTS = loss_module.CHUNK_ELEMENTS, chunk_elements
        tracker = MemTracker()
        tracker.track_external(last, hidden)
        try:
            with tracker:
                loss = last(hidden, positions, labels=labels)
                loss.backward()
        finally:
            loss_module.CHUNK_ELEMENTS = saved
        return loss.detach(), sum(p["Total"] for p in tracker.get_tracker_snapshot("peak").values())

    whole_logits = batch * seq * 4096 * 4  # 16 MiB of float32 logits
    one_chunk, full_peak = peak(2**27)
    chunked, chunked_peak = peak(64 * 4096)  # 64 tokens a chunk: 1 MiB
    with torch.no_grad():
        expected = F.cross_entropy(last(hidden, positions).flatten(0, 1), labels.flatten(), reduction="sum")
    assert one_chunk.ndim == 0
    torch.testing.assert_close(one_chunk, expected, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=1e-3)
    assert full_peak > 2 * whole_logits and chunked_peak < whole_logits, (full_peak, chunked_peak, whole_logits)


def test_on_cpu_dtensor_has_no_rng_tracker_so_ranks_copy_one_init():
    """N8, what the CPU can show: torch refuses DTensor's offset-based RNG tracker on a CPU mesh, so there is no
    rank-0 RNG broadcast to undo (the ranks copy one process's init); `seed_dtensor_rng_per_rank` leaves it alone.
    The GPU side is the CUDA test below."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import _random

    from maester.train.setup import seed_dtensor_rng_per_rank

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
        with pytest.raises(RuntimeError, match="requires the presence of"):
            _random.OffsetBasedRNGTracker(mesh)
        seed_dtensor_rng_per_rank(0, mesh, torch.device("cpu"))
        assert _random._rng_tracker is None
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipeline_stages_on_cuda_draw_their_own_seeds():  # pragma: no cover - GPU check
    """N8 on a GPU: after `seed_dtensor_rng_per_rank` DTensor's RNG tracker exists without having broadcast any
    rank's state, and an FSDP-sharded stage materialised from seed + stage starts that seed's stream: its first
    draw (the embedding) is what a plain model materialised from the seed draws, so stages of different index
    differ. (Later draws differ from the plain model's: the tracker advances the Philox offset by the tensor size,
    the plain kernels by their launch size.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import _random

    from maester.models.build import materialize
    from maester.parallel.devices import process_group_backend
    from maester.train.setup import seed_dtensor_rng_per_rank

    cfg = ModelConfig(name="llama", flavor="tiny", attention="sdpa")
    args = resolve_args(cfg, 256)
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    dist.init_process_group(process_group_backend("cuda"), store=dist.HashStore(), rank=0, world_size=1)
    broadcasts = []
    broadcast = dist.broadcast
    dist.broadcast = lambda *a, **k: broadcasts.append(a) or broadcast(*a, **k)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
        seed_dtensor_rng_per_rank(0, mesh, cuda)
        assert isinstance(_random._rng_tracker, _random.OffsetBasedRNGTracker) and broadcasts == []
        stages = []
        for stage in (0, 1):
            sharded = build_on_meta(cfg, args)
            fully_shard(sharded, mesh=mesh)
            sharded = materialize(sharded, cuda, seed=10 + stage)
            plain = materialize(build_on_meta(cfg, args), cuda, seed=10 + stage)
            first = sharded.tok_embeddings.weight.full_tensor()
            assert torch.equal(first, plain.tok_embeddings.weight), stage
            stages.append(first)
        assert not torch.equal(*stages)
    finally:
        dist.broadcast = broadcast
        _random._rng_tracker = None
        dist.destroy_process_group()
