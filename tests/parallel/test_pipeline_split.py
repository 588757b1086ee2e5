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
