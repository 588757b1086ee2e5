"""The CPU hot path's shortcuts give the numbers of the plain formulations they replace."""

from __future__ import annotations

import pytest
import torch

from maester.models.layers import RMSNorm, RotaryEmbedding, apply_rotary


def rotate_half_reference(x, cos, sin):
    """x * cos + rotate_half(x) * sin over the rotary dims (Hugging Face's formulation), tables of full width."""
    rot = 2 * cos.shape[-1]
    cos, sin = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
    x_rot, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, rest), dim=-1)


@pytest.mark.parametrize("rotary_dim", [16, 8])  # all of a 16-dim head, or half of it (GPT-NeoX)
def test_rotary_by_halves_equals_rotate_half_exactly(rotary_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(rotary_dim, 10000.0)
    rope.reset_parameters()
    x = torch.randn(2, 3, 10, 16, requires_grad=True)
    cos, sin = rope(torch.arange(10).expand(2, 10), torch.float32)
    got, want = apply_rotary(x, cos, sin), rotate_half_reference(x, cos, sin)
    assert torch.equal(got, want)
    grad = torch.randn_like(got)
    assert torch.equal(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0])


def test_default_position_tables_are_kept_until_the_frequencies_change():
    rope = RotaryEmbedding(8, 10000.0)
    rope.reset_parameters()
    first = rope(None, torch.float32, 12, torch.device("cpu"))
    assert rope(None, torch.float32, 12, torch.device("cpu"))[0] is first[0]  # kept, not recomputed
    explicit = rope(torch.arange(12)[None], torch.float32)
    assert torch.equal(first[0], explicit[0]) and torch.equal(first[1], explicit[1])
    assert rope(None, torch.float32, 7, torch.device("cpu"))[0].shape == (1, 7, 4)  # another length: new tables
    rope.theta = 500.0
    rope.reset_parameters()  # new frequencies: the kept tables would be wrong
    assert not torch.equal(rope(None, torch.float32, 7, torch.device("cpu"))[0], first[0][:, :7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_float32_formula(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 5, 32, dtype=dtype, requires_grad=True)
    xf = x.float()
    want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = norm(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
    grad = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0],
                               rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_rms_norm_and_kept_rope_tables_on_cuda():
    """The GPU check's half: torch's fused rms_norm on CUDA against the float32 formula, and the kept RoPE tables
    made on the forward's device."""
    torch.manual_seed(0)
    norm = RMSNorm(64).cuda()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 5, 64, device="cuda")
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
    rope = RotaryEmbedding(16, 10000.0).cuda()
    rope.reset_parameters()
    cos, sin = rope(None, torch.float32, 12, torch.device("cuda", torch.cuda.current_device()))
    assert cos.is_cuda and sin.is_cuda
    explicit = rope(torch.arange(12, device="cuda")[None], torch.float32)
    torch.testing.assert_close(cos, explicit[0])
