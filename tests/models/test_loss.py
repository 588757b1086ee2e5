"""The chunked loss equals the full-logits loss (value and gradients) and peaks at a fraction of its memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maester.models.loss import IGNORE_INDEX, chunk_tokens_for, cross_entropy_sum, linear_cross_entropy_sum


def inputs(tokens=96, vocab=300, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, tokens // 2, dim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    labels[0, :7] = IGNORE_INDEX
    return h, w, labels


@pytest.mark.parametrize("chunk", [1, 7, 32, 96, 1000])
def test_chunked_equals_full_logits(chunk):
    h, w, labels = inputs()
    full = cross_entropy_sum(F.linear(h, w), labels)
    gh, gw = torch.autograd.grad(full, (h, w))
    got = linear_cross_entropy_sum(h, w, labels, chunk_tokens=chunk)
    ch, cw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, full)
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)


@pytest.mark.parametrize("chunk", [7, 1000])
def test_chunked_loss_soft_caps_every_chunk(chunk):
    h, w, labels = inputs()
    capped = 3.0 * torch.tanh(F.linear(h, w).float() / 3.0)  # Gemma 2's final soft-capping, written out
    full = F.cross_entropy(capped.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    gh, gw = torch.autograd.grad(full, (h, w))
    got = linear_cross_entropy_sum(h, w, labels, chunk_tokens=chunk, softcap=3.0)
    ch, cw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, full)
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)
    torch.testing.assert_close(cross_entropy_sum(F.linear(h, w), labels, softcap=3.0), full)
    assert not torch.allclose(linear_cross_entropy_sum(h, w, labels, chunk_tokens=chunk), full)


def test_chunked_without_grad_and_under_autocast():
    h, w, labels = inputs()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy_sum(h, w, labels, chunk_tokens=10),
                                   cross_entropy_sum(F.linear(h, w), labels))
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = cross_entropy_sum(F.linear(h32, w32), labels)
        got = linear_cross_entropy_sum(h32, w32, labels, chunk_tokens=16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=2e-3, atol=1e-2)
    got.backward()
    assert h32.grad.dtype == torch.float32 and torch.isfinite(h32.grad).all()


def test_chunk_size_keeps_logits_bounded():
    assert chunk_tokens_for(262_144) == 512  # Gemma 3: 512 x 262k = 2^27 logits per chunk
    assert chunk_tokens_for(128_256) == 1024
    assert chunk_tokens_for(256) == 2**19


def test_model_loss_with_labels_equals_loss_of_logits():
    from maester.config import load_config
    from maester.models.build import build_model

    cfg = load_config(None, ["--model.flavor=tiny"], environ={})
    model = build_model(cfg.model, 256, torch.device("cpu"), 0, cfg.mup)
    tokens = torch.randint(0, 256, (2, 16))
    labels = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens, labels=labels), cross_entropy_sum(model(tokens), labels))


def test_peak_memory_is_at_most_a_quarter_of_full_logits():
    from benchmarks.loss_memory import main

    out = main(["--tokens", "2048", "--vocab", "65536", "--dim", "32", "--chunk", "256"])
    # Ratios of measurements from one process, not floors in MiB, which depend on the allocator and the machine:
    # the full version holds at least one whole logits tensor (512 MiB here) at its peak, the chunked a quarter
    # of the full one's peak at most.
    assert out["full_over_logits"] >= 1.0, out
    assert out["ratio"] <= 0.25, out
    assert out["chunked"]["loss"] == pytest.approx(out["full"]["loss"], rel=1e-5)
    assert out["chunked"]["grad_h"] == pytest.approx(out["full"]["grad_h"], rel=1e-4)
    assert out["chunked"]["grad_w"] == pytest.approx(out["full"]["grad_w"], rel=1e-4)
