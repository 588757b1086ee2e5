"""Muon on one process: Newton-Schulz, the step against the reference, the AdamW part against torch's AdamW,
fused matrices, NorMuon, errors, and saving the state (state_dict and DCP)."""

from __future__ import annotations

import copy

import pytest
import torch

from maester.train.muon import Muon, momentum_at, newton_schulz, shape_scale
from tests.train.muon_reference import reference_muon_step

SHAPES = [(24, 12), (12, 24), (16, 16)]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def svdvals_after(shape, coefficients, seed):
    return torch.linalg.svdvals(newton_schulz(randn(*shape, seed=seed), 5, coefficients))


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (128, 16), (7, 5)])
def test_newton_schulz_puts_singular_values_in_a_band(shape):
    """Measured on Gaussian matrices (aspect ratio >= 1.4): quintic 0.682..1.134, Polar Express 0.859..1.141."""
    quintic_worst = polar_worst = 0.0
    for seed in range(5):
        quintic = svdvals_after(shape, "quintic", seed)
        polar = svdvals_after(shape, "polar_express", seed)
        assert quintic.min() > 0.67 and quintic.max() < 1.14, quintic
        assert polar.min() > 0.85 and polar.max() < 1.15, polar
        quintic_worst = max(quintic_worst, (quintic - 1).abs().max())
        polar_worst = max(polar_worst, (polar - 1).abs().max())
    assert polar_worst < 0.6 * quintic_worst


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_newton_schulz_keeps_the_singular_vectors(coefficients):
    """O = A f(S) B^T for U = A S B^T: NS acts on the singular values only, in either orientation."""
    for shape in [(20, 8), (8, 20)]:
        U = randn(*shape, seed=3)
        A, _, Bt = torch.linalg.svd(U, full_matrices=False)
        inner = A.T @ newton_schulz(U, 5, coefficients) @ Bt.T
        off_diagonal = inner - torch.diag(torch.diagonal(inner))
        assert off_diagonal.abs().max() < 1e-5
        assert torch.diagonal(inner).min() > 0.6


def test_newton_schulz_of_zero_is_zero():
    assert torch.equal(newton_schulz(torch.zeros(4, 6), 5), torch.zeros(4, 6))


def test_polar_express_repeats_its_last_coefficients_past_five_steps():
    from maester.train.muon import POLAR_EXPRESS

    U = randn(12, 6, seed=0)
    X = newton_schulz(U, 5, "polar_express")
    a, b, c = POLAR_EXPRESS[-1]
    A = X.T @ X
    torch.testing.assert_close(newton_schulz(U, 6, "polar_express"), a * X + X @ (b * A + c * A @ A),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="coefficients 'cubic'"):
        newton_schulz(U, 5, "cubic")


def test_newton_schulz_in_bfloat16_is_close_to_float32():
    U = randn(32, 16, seed=4)
    low = newton_schulz(U, 5, dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), newton_schulz(U, 5), rtol=0, atol=0.05)


def grads_for(shape, step, seed=0):
    return randn(*shape, seed=1000 * seed + step)


MUON_SETTINGS = {
    "default": {},
    "no-nesterov": {"nesterov": False},
    "match_adamw": {"lr_scaling": "match_adamw", "weight_decay": 0.1},
    "none-scaling": {"lr_scaling": "none"},
    "momentum-warmup": {"momentum_warmup_steps": 2, "momentum_warmup_start": 0.5},
    "normuon": {"normuon": True, "normuon_beta2": 0.9, "weight_decay": 0.05},
    "polar-express": {"coefficients": "polar_express", "ns_steps": 6},
}


@pytest.mark.parametrize("setting", MUON_SETTINGS)
def test_step_matches_the_reference(setting):
    kwargs = MUON_SETTINGS[setting]
    coefficients = kwargs.get("coefficients", "quintic")
    group_kwargs = {k: v for k, v in kwargs.items() if k != "coefficients"}
    params = [torch.nn.Parameter(randn(*s, seed=i)) for i, s in enumerate(SHAPES)]
    refs = [p.detach().clone() for p in params]
    states = [{} for _ in params]
    opt = Muon([{"params": params, "muon": True}], lr=0.05, coefficients=coefficients, **group_kwargs)
    for step in range(4):
        for i, (p, ref) in enumerate(zip(params, refs)):
            p.grad = grads_for(p.shape, step, seed=i)
            reference_muon_step(ref, p.grad.clone(), states[i], lr=0.05, coefficients=coefficients, **group_kwargs)
        opt.step()
        for p, ref in zip(params, refs):
            torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-6)
    for p, state in zip(params, states):  # the state moved too, not just the weights
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], state["momentum_buffer"], rtol=1e-6, atol=1e-6)
        if "normuon_v" in state:
            torch.testing.assert_close(opt.state[p]["normuon_v"], state["normuon_v"], rtol=1e-5, atol=1e-9)


def test_momentum_warmup_rises_linearly_to_the_full_momentum():
    assert [momentum_at(s, 0.95, 2, 0.85) for s in (1, 2, 3, 10)] == pytest.approx([0.85, 0.9, 0.95, 0.95])
    assert momentum_at(1, 0.95, 0, 0.85) == 0.95


def test_adamw_groups_equal_torch_adamw_exactly():
    shapes = [(6, 5), (5,), (3, 4)]
    ours = [torch.nn.Parameter(randn(*s, seed=i)) for i, s in enumerate(shapes)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    muon = Muon([{"params": ours[:2], "muon": False, "weight_decay": 0.1},
                 {"params": ours[2:], "muon": False, "weight_decay": 0.0, "lr": 3e-3}],
                lr=1e-2, betas=(0.8, 0.9), eps=1e-7)
    adamw = torch.optim.AdamW([{"params": theirs[:2], "weight_decay": 0.1},
                               {"params": theirs[2:], "weight_decay": 0.0, "lr": 3e-3}],
                              lr=1e-2, betas=(0.8, 0.9), eps=1e-7)
    for step in range(5):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            a.grad = grads_for(a.shape, step, seed=i)
            b.grad = a.grad.clone()
        muon.step()
        adamw.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(muon.state[a][key], adamw.state[b][key], rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [{}, {"normuon": True}, {"lr_scaling": "match_adamw"}],
                         ids=["default", "normuon", "match_adamw"])
def test_fused_matrix_equals_its_pieces_stepped_separately(kwargs):
    rows, cols = (6, 4, 4), 8
    fused = torch.nn.Parameter(randn(sum(rows), cols, seed=0))
    pieces = [torch.nn.Parameter(t.clone()) for t in fused.detach().split(rows)]
    opt_fused = Muon([{"params": [fused], "muon": True}], lr=0.05, splits={fused: rows}, **kwargs)
    opt_pieces = Muon([{"params": pieces, "muon": True}], lr=0.05, **kwargs)
    for step in range(3):
        fused.grad = grads_for(fused.shape, step)
        for piece, g in zip(pieces, fused.grad.split(rows)):
            piece.grad = g.clone()
        opt_fused.step()
        opt_pieces.step()
        torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in pieces]), rtol=1e-6, atol=1e-7)
    # and not the same as orthogonalising the fused matrix whole
    whole = torch.nn.Parameter(randn(sum(rows), cols, seed=0))
    opt_whole = Muon([{"params": [whole], "muon": True}], lr=0.05, **kwargs)
    for step in range(3):
        whole.grad = grads_for(whole.shape, step)
        opt_whole.step()
    assert not torch.allclose(whole, fused, atol=1e-4)


def test_normuon_gives_rows_of_equal_norm_and_keeps_the_frobenius_norm():
    """First step, no momentum history: v = (1 - beta2) mean(O^2) per row, so every normalised row has the same
    norm, and the rescale restores |O|_F (times the shape scale)."""
    p = torch.nn.Parameter(torch.zeros(12, 8))
    p.grad = randn(12, 8, seed=5)
    Muon([{"params": [p], "muon": True}], lr=1.0, normuon=True, nesterov=False).step()
    update = -p.detach()
    row_norms = update.norm(dim=1)
    torch.testing.assert_close(row_norms, row_norms.mean().expand(12), rtol=1e-5, atol=0)
    expected = shape_scale(12, 8, "spectral") * newton_schulz(p.grad, 5).norm()
    torch.testing.assert_close(update.norm(), expected, rtol=1e-5, atol=0)


def test_zero_gradients_leave_parameters_finite_and_unchanged_at_lr_zero():
    """What torch.distributed.checkpoint does to create the state of a fresh optimizer before loading into it."""
    params = [torch.nn.Parameter(randn(6, 4, seed=0)), torch.nn.Parameter(randn(4, seed=1))]
    before = [p.detach().clone() for p in params]
    opt = Muon([{"params": params[:1], "muon": True}, {"params": params[1:], "muon": False}], lr=0.0,
               normuon=True, weight_decay=0.1)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


def test_a_vector_in_a_muon_group_is_an_error_naming_the_group():
    with pytest.raises(ValueError, match=r"param group hidden .* shape \(8,\)"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(8))], "muon": True, "name": "hidden"}])


def test_a_group_without_the_muon_key_is_an_error():
    with pytest.raises(ValueError, match="param group #0 has no 'muon' key"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(8, 8))]}])


@pytest.mark.parametrize("kwargs, match", [
    ({"lr_scaling": "mup"}, "lr_scaling 'mup'"),
    ({"ns_steps": 0}, "ns_steps must be at least 1"),
    ({"coefficients": "cubic"}, "coefficients 'cubic'"),
])
def test_bad_settings_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(8, 8))], "muon": True}], **kwargs)


def test_bad_splits_are_errors():
    p, q = torch.nn.Parameter(torch.zeros(8, 4)), torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match=r"splits \(3, 4\) .* summing to 8"):
        Muon([{"params": [p], "muon": True}], splits={p: (3, 4)})
    with pytest.raises(ValueError, match="in no param group"):
        Muon([{"params": [p], "muon": True}], splits={q: (4, 4)})
    Muon([{"params": [p], "muon": True}, {"params": [q], "muon": False}], splits={q: (4, 4)})  # unused: fine


def make_pair(**kwargs):
    params = [torch.nn.Parameter(randn(10, 6, seed=0)), torch.nn.Parameter(randn(9, 6, seed=1)),
              torch.nn.Parameter(randn(6, seed=2))]
    opt = Muon([{"params": params[:2], "muon": True}, {"params": params[2:], "muon": False}], lr=0.02,
               splits={params[1]: (3, 3, 3)}, normuon=True, momentum_warmup_steps=3, **kwargs)
    return params, opt


def run_steps(params, opt, steps):
    for step in steps:
        for i, p in enumerate(params):
            p.grad = grads_for(p.shape, step, seed=i)
        opt.step()


def test_state_dict_round_trip_continues_identically():
    params, opt = make_pair()
    run_steps(params, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())  # as read back from a file: state_dict() shares the tensors
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = Muon([{"params": copies[:2], "muon": True}, {"params": copies[2:], "muon": False}], lr=0.02,
                 splits={copies[1]: (3, 3, 3)}, normuon=True, momentum_warmup_steps=3)
    fresh.load_state_dict(saved)
    run_steps(params, opt, range(2, 5))
    run_steps(copies, fresh, range(2, 5))
    for a, b in zip(params, copies):
        assert torch.equal(a, b)


def test_dcp_save_and_load_continues_identically(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = torch.nn.ParameterList(make_pair()[0])
    params = list(model)
    opt = Muon([{"params": params[:2], "muon": True}, {"params": params[2:], "muon": False}], lr=0.02,
               splits={params[1]: (3, 3, 3)}, normuon=True, momentum_warmup_steps=3)
    run_steps(params, opt, range(2))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)

    twin = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in params])
    copies = list(twin)
    fresh = Muon([{"params": copies[:2], "muon": True}, {"params": copies[2:], "muon": False}], lr=0.02,
                 splits={copies[1]: (3, 3, 3)}, normuon=True, momentum_warmup_steps=3)
    state = {"optimizer": get_optimizer_state_dict(twin, fresh)}  # creates the state it loads into
    for p, c in zip(params, copies):  # creating the state ran a step at lr 0 on zero gradients: nothing moved
        assert torch.equal(p, c)
    dcp.load(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    set_optimizer_state_dict(twin, fresh, state["optimizer"])
    assert int(fresh.state[copies[0]]["step"]) == 2
    run_steps(params, opt, range(2, 5))
    run_steps(copies, fresh, range(2, 5))
    for a, b in zip(params, copies):
        assert torch.equal(a, b)


def test_normuon_switched_on_without_its_state_is_an_error():
    p = torch.nn.Parameter(randn(6, 4, seed=0))
    opt = Muon([{"params": [p], "muon": True}])
    p.grad = randn(6, 4, seed=1)
    opt.step()
    with_normuon = Muon([{"params": [p], "muon": True}], normuon=True)
    with_normuon.load_state_dict(copy.deepcopy(opt.state_dict()))
    with_normuon.param_groups[0]["normuon"] = True  # load_state_dict took the saved group's settings
    with pytest.raises(ValueError, match="NorMuon on but no 'normuon_v' state"):
        with_normuon.step()
