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
