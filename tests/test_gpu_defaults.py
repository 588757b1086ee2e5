"""`_MAESTER_GPU_DEFAULTS=1`: a CPU run resolves the `auto` settings the CPU can honour as a CUDA run does, and
leaves the ones it cannot (`maester.gpu_defaults.NOT_ON_THE_CPU`) as the CPU has them."""

from __future__ import annotations

import pytest
import torch

from maester.gpu_defaults import GPU_DEFAULTS_ENV, NOT_ON_THE_CPU, resolves_as
from maester.parallel.precision import inference_dtype, resolve_precision
from maester.train.checkpoint_async import resolve_async_mode
from maester.train.muon import Muon

CPU = torch.device("cpu")


@pytest.fixture
def gpu_defaults(monkeypatch):
    monkeypatch.setenv(GPU_DEFAULTS_ENV, "1")


def test_without_the_switch_a_cpu_run_takes_the_cpu_defaults(monkeypatch):
    monkeypatch.delenv(GPU_DEFAULTS_ENV, raising=False)
    assert resolves_as("cpu") == "cpu"
    assert resolve_precision("auto", "auto", "cpu", fsdp=False).mode == "fp32"
    assert resolve_async_mode("auto", "cpu") == "off"
    assert inference_dtype("auto", "cpu") == torch.float32


def test_the_switch_resolves_auto_as_cuda_does(gpu_defaults):
    assert resolves_as("cpu") == "cuda" and resolves_as("mps") == "mps"
    for fsdp in (False, True):
        assert resolve_precision("auto", "auto", "cpu", fsdp) == resolve_precision("auto", "auto", "cuda", fsdp)
    assert resolve_precision("auto", "auto", "cpu", fsdp=False).autocast_dtype == torch.bfloat16
    assert resolve_async_mode("auto", "cpu") == resolve_async_mode("auto", "cuda") == "async"
    assert inference_dtype("auto", "cpu") == inference_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_precision("fp32", "auto", "cpu", fsdp=False).mode == "fp32"  # set values stay as set


def _muon_step(ns_dtype) -> torch.Tensor:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(16, 8))
    weight.grad = torch.randn(16, 8)
    Muon([{"params": [weight], "muon": True}], lr=0.1, ns_dtype=ns_dtype).step()
    return weight.detach()


def test_muon_newton_schulz_in_bfloat16_under_the_switch(gpu_defaults, monkeypatch):
    switched = _muon_step(None)
    assert torch.equal(switched, _muon_step(torch.bfloat16))
    monkeypatch.delenv(GPU_DEFAULTS_ENV)
    assert torch.equal(_muon_step(None), _muon_step(torch.float32))
    assert not torch.equal(switched, _muon_step(None))


def test_what_the_cpu_cannot_honour_stays_as_the_cpu_has_it(gpu_defaults):
    from maester.models.layers import resolve_attention

    assert {"training.device = auto", "model.attention = auto", "checkpoint.async_mode = pinned"} <= set(NOT_ON_THE_CPU)
    assert resolve_attention("auto", CPU, has_documents=True) == "sdpa"  # flex on CUDA: no backward on the CPU
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_async_mode("pinned", "cpu")
