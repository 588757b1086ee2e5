"""Context parallel's split of a sequence and its masks, in one process (the collectives are exercised by
tests/distributed/test_context_parallel.py), and the layouts it refuses."""

from __future__ import annotations

import pytest
import torch

from maester.config import load_config
from maester.data.batch import make_batch
from maester.models.layers import ContextSplit, attend, attention_mask, document_causal_mask
from maester.parallel.context_parallel import ContextParallel
from maester.parallel.dims import ParallelDims
from tests.helpers import REPO

LONG_CONTEXT = REPO / "configs" / "llama3" / "8b-sft-long-context.toml"


@pytest.mark.parametrize("cp", [2, 4])
def test_ranks_hold_every_token_once_with_equal_causal_work(cp):
    seq = 8 * cp
    ranks = [ContextParallel(cp, r, "unused") for r in range(cp)]
    held = [rank.token_indices(seq, torch.device("cpu")) for rank in ranks]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    chunk = seq // (2 * cp)
    assert held[0][:chunk].tolist() == list(range(chunk))  # rank 0: the first chunk and the last
    assert held[0][chunk:].tolist() == list(range(seq - chunk, seq))
    # Load balance: every rank's queries see as many keys under the causal mask.
    assert len({int((idx + 1).sum()) for idx in held}) == 1


def test_shard_and_split_masks_are_rows_of_the_whole_mask():
    cp, seq = 2, 16
    rows = torch.randint(1, 9, (2, seq + 1))
    rows[:, 5] = 0  # an EOS: two documents in each row
    whole = make_batch(rows, document_masking=True, eos_id=0)
    assert whole.document_ids.max() == 1
    full_mask = document_causal_mask(whole.document_ids, seq, torch.device("cpu"), window=5)
    keys = torch.cat([ContextParallel(cp, r, "unused").token_indices(seq, torch.device("cpu")) for r in range(cp)])
    for r in range(cp):
        rank = ContextParallel(cp, r, "unused")
        idx = rank.token_indices(seq, torch.device("cpu"))
        part = rank.shard(whole)
        for name in ("input_ids", "labels", "position_ids", "document_ids"):
            assert torch.equal(getattr(part, name), getattr(whole, name)[:, idx]), name
        split = ContextSplit(idx, keys, whole.document_ids[:, keys], None)
        mask = document_causal_mask(part.document_ids, seq // cp, torch.device("cpu"), 5, split)
        assert torch.equal(mask, full_mask[:, :, idx][..., keys])


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU, by design
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 6])
def test_a_ranks_attention_is_its_rows_of_the_whole_attention(backend, window, device):
    """Each rank's queries over every rank's keys (given whole here: one process holds them), with its mask for
    the backend, equal the whole sequence's attention at its rows; and the ranks' gradients, the keys' summed over
    the ranks (what the gather's reduce-scatter does), equal the whole attention's. CPU has no flex backward:
    there flex is checked forward only."""
    cp, seq, device = 2, 256, torch.device(device)
    trains = backend == "sdpa" or device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, seq, 16, generator=gen).to(device).requires_grad_(trains) for heads in (4, 2, 2))
    weights = torch.randn(2, seq, 4, 16, generator=gen).to(device)
    documents = torch.cat([torch.zeros(2, 100), torch.ones(2, 130), torch.full((2, 26), -1)], 1).long().to(device)
    expected = attend(q, k, v, attention_mask("sdpa", documents, 2, seq, device, trains, window))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v)) if trains else None
    keys = torch.cat([ContextParallel(cp, r, "unused").token_indices(seq, device) for r in range(cp)])
    total = 0
    for r in range(cp):
        idx = ContextParallel(cp, r, "unused").token_indices(seq, device)
        split = ContextSplit(idx, keys, documents[:, keys], None)
        mask = attention_mask(backend, documents[:, idx], 2, seq // cp, device, trains, window, split=split)
        assert mask.backend == backend
        got = attend(q[:, :, idx], k[:, :, keys], v[:, :, keys], mask)
        torch.testing.assert_close(got, expected[:, idx], rtol=0, atol=1e-5 if device.type == "cpu" else 2e-4)
        total = total + (got * weights[:, idx]).sum()
    if trains:
        for name, got, want in zip("qkv", torch.autograd.grad(total, (q, k, v)), expected_grads):
            err = (got - want).norm() / want.norm()
            assert err < (1e-5 if device.type == "cpu" else 2e-3), f"gradient of {name} differs by {err:.2e}"


@pytest.mark.parametrize("world", [8, 16, 32, 64])
def test_long_context_sft_config_lays_out_on_8_to_64_gpus(world):
    cfg = load_config(LONG_CONTEXT, environ={})
    d = ParallelDims.from_config(cfg, world)
    assert (d.cp, d.dp_shard, d.tp, d.dp_size) == (8, world // 8, 1, world // 8) and d.fsdp_enabled
    assert d.batch_plan(cfg, dp_rank=0).accumulation_steps == 8 // d.dp_size
    assert cfg.data.mode == "sft" and cfg.data.seq_len == 65536 <= cfg.model.architecture().max_seq_len
    assert cfg.parallel.activation_checkpointing == "selective-op"
    assert cfg.data.seq_len // (2 * d.cp) % 128 == 0  # whole FlexAttention blocks per chunk


def test_long_context_sft_config_refuses_fewer_gpus_than_cp():
    with pytest.raises(ValueError, match="does not divide the 4 process"):
        ParallelDims.from_config(load_config(LONG_CONTEXT, environ={}), 4)
