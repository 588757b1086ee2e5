"""Optimizer construction: groups by rules (and their audit, with and without μP), classes by name, errors."""

from __future__ import annotations

import logging

import pytest
import torch

from maester.config import ModelConfig, MupConfig, OptimizerConfig
from maester.models.build import build_model
from maester.train.metrics import format_console_line
from maester.train.optim import build_optimizer

CPU = torch.device("cpu")
LR, MUON_LR, WD = 1e-3, 0.02, 0.1


def tiny_model(name="llama", width=None, mup=None, **overrides):
    cfg = ModelConfig(name=name, flavor="tiny", width=width, overrides=overrides)
    return build_model(cfg, 269, CPU, 0, mup)


def audit(model, opt) -> dict[str, tuple[float, float, bool]]:
    """Parameter name -> (lr, weight decay, takes Muon) as the optimizer holds them."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g in opt.param_groups:
        for p in g["params"]:
            assert names[id(p)] not in out, f"{names[id(p)]} is in two groups"
            out[names[id(p)]] = (g["lr"], g.get("weight_decay", 0.0), g.get("muon", False))
    assert set(out) == set(names.values()), "every trainable parameter is in exactly one group"
    return out


def expected(name: str, ndim: int, m: float, optimizer: str, lr_scaling: str = "spectral"):
    """The table of the issue: no decay on embeddings, norms and biases; μP divides the Adam LR of the hidden
    matrices by m and leaves embedding and readout alone; Muon takes the hidden matrices."""
    hidden = name.startswith("layers.") and ndim == 2
    no_decay = name.startswith("tok_embeddings.") or ndim < 2
    wd = 0.0 if no_decay else WD
    if optimizer == "muon" and hidden:
        return MUON_LR / (m if lr_scaling == "match_adamw" else 1.0), wd, True
    if optimizer == "sgd":
        return (LR if hidden else LR * m), wd, False
    return (LR / m if hidden else LR), wd, False


@pytest.mark.parametrize("optimizer, width, lr_scaling", [
    ("adamw", None, "spectral"), ("adamw", 256, "spectral"), ("sgd", 256, "spectral"),
    ("muon", None, "spectral"), ("muon", 256, "spectral"), ("muon", 256, "match_adamw"),
])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_group_audit(optimizer, width, lr_scaling, tied):
    mup = MupConfig(enabled=True, base_width=64) if width else None
    model = tiny_model(width=width, mup=mup, tie_embeddings=tied, attention_bias=True)
    m = (width or 64) / 64
    assert model.args.width_mult == m
    cfg = OptimizerConfig(name=optimizer, lr=LR, weight_decay=WD, muon={"lr": MUON_LR, "lr_scaling": lr_scaling})
    got = audit(model, build_optimizer(model, cfg, CPU))
    for name, p in model.named_parameters():
        lr, wd, muon = expected(name, p.ndim, m, optimizer, lr_scaling)
        assert got[name] == (pytest.approx(lr, rel=1e-12), wd, muon), name
    # the table's rows are all there: embeddings, norms, biases, hidden matrices (and an untied readout)
    assert {"tok_embeddings.weight", "norm.weight", "layers.0.attention.q_proj.bias",
            "layers.0.feed_forward.down_proj.weight"} <= set(got)
    assert ("output.weight" in got) == (not tied)


def test_rules_come_first_in_order_and_the_groups_are_logged(caplog):
    model = tiny_model()
    cfg = OptimizerConfig(lr=LR, weight_decay=WD, groups=[
        {"name": "attention", "params": ["layers.*.attention.*"], "ndim": [2], "lr_multiplier": 0.5,
         "weight_decay": 0.01},
        {"name": "layer0", "params": ["layers.0.*"], "lr_multiplier": 2.0},  # after `attention`: its MLP only
        {"name": "norms", "params": ["*norm*"], "weight_decay": 0.3},
    ])
    with caplog.at_level(logging.INFO, logger="maester"):
        opt = build_optimizer(model, cfg, CPU, log_groups=True)
    got = audit(model, opt)
    assert got["layers.1.attention.q_proj.weight"] == (LR * 0.5, 0.01, False)
    assert got["layers.0.attention.o_proj.weight"] == (LR * 0.5, 0.01, False)
    assert got["layers.0.feed_forward.up_proj.weight"] == (LR * 2.0, WD, False)
    assert got["layers.0.attention_norm.weight"] == (LR * 2.0, WD, False)  # layer0 matched before norms
    assert got["layers.1.ffn_norm.weight"] == (LR, 0.3, False)
    assert got["tok_embeddings.weight"] == (LR, 0.0, False) and got["output.weight"] == (LR, WD, False)
    assert [g["name"] for g in opt.param_groups] == ["attention", "layer0", "norms", "embeddings", "decay"]
    table = caplog.text
    assert "optimizer adamw (AdamW) at lr 0.001; weight decay 0.1, decoupled (AdamW-style); per group below; " \
        "width multiplier 1" in table
    assert "attention" in table and "layers.0.attention.q_proj.weight" in table and "0.0005" in table


@pytest.mark.parametrize("name, cls, kwargs, check", [
    ("adam", torch.optim.Adam, {}, lambda d: d["betas"] == (0.9, 0.95) and d["eps"] == 1e-8),
    ("sgd", torch.optim.SGD, {"nesterov": True}, lambda d: d["momentum"] == 0.9 and d["nesterov"]),
    ("RMSprop", torch.optim.RMSprop, {"alpha": 0.9}, lambda d: d["alpha"] == 0.9 and d["eps"] == 1e-8),
    ("Adagrad", torch.optim.Adagrad, {}, lambda d: d["eps"] == 1e-10),  # the class's own eps: not Adam-family
    ("torch.optim.NAdam", torch.optim.NAdam, {"momentum_decay": 0.002}, lambda d: d["momentum_decay"] == 0.002),
])
def test_any_torch_optimizer_by_name_with_its_keyword_arguments(name, cls, kwargs, check):
    model = tiny_model()
    opt = build_optimizer(model, OptimizerConfig(name=name, lr=LR, momentum=0.9, kwargs=kwargs), CPU)
    assert type(opt) is cls and check(opt.defaults)
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 269, (2, 8), generator=torch.Generator().manual_seed(0))
    # Scaled: SGD's step is lr x gradient, and the smallest gradients of this loss (about 1e-5, on norm weights of
    # 1.0) made steps below float32's rounding of 1.0 for some inputs, so no element moved. The other optimizers'
    # first steps do not depend on the loss's scale.
    (model(tokens).float().pow(2).mean() * 1e4).backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fused_and_foreach_implementations():
    model = tiny_model()
    assert build_optimizer(model, OptimizerConfig(), CPU).defaults["fused"]  # auto: fused on CPU too
    assert build_optimizer(model, OptimizerConfig(name="RMSprop"), CPU).defaults["foreach"]  # no fused kernel
    assert build_optimizer(model, OptimizerConfig(implementation="fused"), CPU).defaults["fused"]
    plain = build_optimizer(model, OptimizerConfig(implementation="for-loop"), CPU).defaults
    assert not plain["foreach"] and not plain["fused"]


@pytest.mark.parametrize("cfg, message", [
    (dict(name="Adamm"), r"optimizer.name 'Adamm' is not a torch.optim class \(those are: .*AdamW"),
    (dict(name="nowhere.Optim"), r"optimizer.name 'nowhere.Optim' cannot be imported"),
    (dict(name="torch.nn.Linear"), r"optimizer.name 'torch.nn.Linear' is .*not a torch.optim.Optimizer subclass"),
    (dict(kwargs={"amsgard": True}), r"optimizer.kwargs.amsgard: AdamW takes no argument 'amsgard'"),
    (dict(name="Rprop", weight_decay=0.1), r"optimizer.name 'Rprop' takes no weight_decay: set "
                                           r"optimizer.weight_decay = 0"),
    (dict(name="LBFGS", weight_decay=0.0, implementation="fused"), r"LBFGS has no fused implementation"),
])
def test_bad_optimizer_settings_name_the_key(cfg, message):
    with pytest.raises(ValueError, match=message):
        build_optimizer(tiny_model(), OptimizerConfig(**cfg), CPU)


def test_config_refuses_muon_rules_without_muon_and_duplicate_rule_names():
    with pytest.raises(ValueError, match=r"optimizer.groups \(x\) set `muon`, but optimizer.name is 'adamw'"):
        OptimizerConfig(groups=[{"name": "x", "muon": True}])
    with pytest.raises(ValueError, match="the rule name.s. x appear more than once"):
        OptimizerConfig(groups=[{"name": "x"}, {"name": "x"}])


def test_muon_rule_on_a_vector_is_refused():
    cfg = OptimizerConfig(name="muon", groups=[{"name": "norms", "params": ["*norm*"], "muon": True}])
    with pytest.raises(ValueError, match=r"rule 'norms' sends layers.0.attention_norm.weight \(shape \(64,\)\) to "
                                         r"Muon, which takes matrices only"):
        build_optimizer(tiny_model(), cfg, CPU)


def test_mup_needs_a_known_lr_rule():
    model = tiny_model(width=128, mup=MupConfig(enabled=True, base_width=64))
    with pytest.raises(ValueError, match="it has no rule for optimizer.name 'LBFGS'"):
        build_optimizer(model, OptimizerConfig(name="LBFGS", weight_decay=0.0), CPU)


@pytest.mark.parametrize("name, decay", [("adamw", 0.1), ("muon", 0.1), ("adam", 0.0), ("sgd", 0.0),
                                         ("RMSprop", 0.0)])
def test_default_weight_decay_is_decoupled_decay_only(name, decay):
    """0.1 by default where the decay is AdamW-style (decoupled); none where the optimizer would apply it as L2."""
    model = tiny_model()
    decays = {g["name"].split("/")[0]: g["weight_decay"] for g in
              build_optimizer(model, OptimizerConfig(name=name), CPU).param_groups}
    assert decays == {"embeddings": 0.0, "no_decay": 0.0, "decay": decay}
    explicit = build_optimizer(model, OptimizerConfig(name=name, weight_decay=0.05), CPU)
    assert {g["name"].split("/")[0]: g["weight_decay"] for g in explicit.param_groups}["decay"] == 0.05


@pytest.mark.parametrize("cfg, line", [
    (dict(name="muon", lr=3e-3), "optimizer muon: hidden matrices on Muon at lr 0.02 (optimizer.muon.lr), the rest on "
                                 "AdamW at lr 0.003 (optimizer.lr); weight decay 0.1, decoupled (AdamW-style); per "
                                 "group below"),
    (dict(name="adam", lr=8e-6), "optimizer adam (Adam) at lr 8e-06; no weight decay (L2 in Adam; adamw decouples it)"),
    (dict(name="adam", weight_decay=0.01), "optimizer adam (Adam) at lr 0.0003; weight decay 0.01 as L2 "
                                           "regularisation (added to the gradient, as Adam applies it; adamw "
                                           "decouples it)"),
])
def test_the_first_log_lines_say_each_lr_and_how_decay_acts(cfg, line, caplog):
    with caplog.at_level(logging.INFO, logger="maester"):
        opt = build_optimizer(tiny_model(), OptimizerConfig(**cfg), CPU, log_groups=True)
    assert caplog.records[0].getMessage().startswith(line + "; width multiplier 1:\n")
    record = {"step": 1, "loss": 5.0, "lr": opt.param_groups[-1]["lr"], "grad_norm": 1.0, "tokens_per_second": 1.0,
              "data_loading_seconds": 0.0, "peak_memory_gib": 0.1,
              **{f"lr/{g['name']}": g["lr"] for g in opt.param_groups}}
    assert format_console_line(record).startswith(
        "step 1 | loss 5.0000 | lr " + ("0.003 (muon 0.02) |" if cfg["name"] == "muon" else f"{record['lr']:.3g} |"))
