"""Optimizer construction: parameter groups by rules, μP learning rates, and the optimizer class by name.

Every parameter takes the first rule (`optimizer.groups`, then `DEFAULT_RULES`) whose name patterns and tensor
ranks match it. A rule sets the LR multiplier and weight decay; μP then divides the LR of hidden matrices by the
width multiplier m (Adam-family), and with `muon` the hidden matrices take the Muon update. The resulting groups
are logged once, as a table, at the start of a run.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import logging
from dataclasses import dataclass

import torch
from torch import nn

from maester.config import OptimizerConfig, ParamGroupRule
from maester.models.transformer import canonical_parameter_name, parameter_roles
from maester.train.grad_scaler import LossScaler

log = logging.getLogger("maester")

DEFAULT_RULES = (
    ParamGroupRule(name="embeddings", params=["tok_embeddings.*"], weight_decay=0.0),
    ParamGroupRule(name="no_decay", ndim=[0, 1], weight_decay=0.0),  # norm gains and biases
    ParamGroupRule(name="decay"),
)
"""Weight decay on matrices only: never on embeddings, norms or biases."""

BUILTIN = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
# Optimizers whose update is normalised per coordinate, like Adam's: μP scales their hidden-matrix LR by 1/m.
ADAPTIVE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "Muon"}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """`optimizer.name` as a class: a built-in name, a `torch.optim` class or an importable dotted path."""
    if name == "muon":
        from maester.train.muon import Muon

        return Muon
    if name in BUILTIN:
        return BUILTIN[name]
    if "." not in name:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            known = sorted(n for n, c in vars(torch.optim).items()
                           if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and n != "Optimizer")
            raise ValueError(f"optimizer.name {name!r} is not a torch.optim class (those are: {', '.join(known)}; "
                             f"or give package.module.Class)")
    else:
        module, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"optimizer.name {name!r} cannot be imported: {e}") from e
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"optimizer.name {name!r} is {cls!r}, not a torch.optim.Optimizer subclass")
    return cls


def matching_rule(name: str, ndim: int, rules: tuple[ParamGroupRule, ...]) -> ParamGroupRule:
    for rule in rules:
        if (rule.ndim is None or ndim in rule.ndim) and any(fnmatch.fnmatchcase(name, pat) for pat in rule.params):
            return rule
    raise ValueError(f"no optimizer.groups rule takes parameter {name!r}")  # the defaults end with a catch-all


@dataclass
class _Group:
    name: str
    rule: str
    lr: float
    lr_multiplier: float
    weight_decay: float
    muon: bool
    names: list[str]
    params: list[torch.Tensor]


def mup_lr_multiplier(cfg: OptimizerConfig, role: str, muon: bool, m: float) -> float:
    """μP's LR factor for a parameter of `role` at width multiplier `m` (1.0 without μP).

    Adam-family: hidden matrices x 1/m; embeddings, readout and vectors unchanged. SGD: hidden unchanged, the
    others x m. Muon: its `spectral` and `none` scalings already give hidden updates a width-independent spectral
    norm (the spectral condition for μP), so no factor; `match_adamw` makes the update Adam-like, so x 1/m.
    """
    if m == 1.0:
        return 1.0
    if muon:
        return 1.0 / m if cfg.muon.lr_scaling == "match_adamw" else 1.0
    if cfg.name == "sgd":
        return 1.0 if role == "hidden" else m
    return 1.0 / m if role == "hidden" else 1.0


def resolve_groups(model: nn.Module, cfg: OptimizerConfig, width_mult: float = 1.0) -> list[_Group]:
    """The parameter groups: one per rule, split by update (Muon or AdamW) and μP LR factor, in rule order."""
    rules = tuple(cfg.groups) + DEFAULT_RULES
    roles = parameter_roles(model)
    groups: dict[tuple, _Group] = {}
    for raw, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = canonical_parameter_name(raw)
        rule = matching_rule(name, p.ndim, rules)
        muon = False
        if cfg.name == "muon":
            muon = rule.muon if rule.muon is not None else roles[name] == "hidden"
            if muon and p.ndim != 2:
                raise ValueError(f"optimizer.groups rule {rule.name!r} sends {name} (shape {tuple(p.shape)}) to "
                                 f"Muon, which takes matrices only")
        mup = mup_lr_multiplier(cfg, roles[name], muon, width_mult)
        base_lr = cfg.muon.lr if muon else cfg.lr
        default_wd = (cfg.muon.weight_decay if muon and cfg.muon.weight_decay is not None
                      else cfg.resolved_weight_decay)
        wd = rule.weight_decay if rule.weight_decay is not None else default_wd
        key = (rule.name, muon, mup)
        if key not in groups:
            suffix = ("/muon" if muon else "/adamw") if cfg.name == "muon" else ""
            suffix += f"/mup{mup:g}" if mup != 1.0 else ""
            groups[key] = _Group(rule.name + suffix, rule.name, base_lr * rule.lr_multiplier * mup,
                                 rule.lr_multiplier * mup, wd, muon, [], [])
        groups[key].names.append(name)
        groups[key].params.append(p)
    order = {r.name: i for i, r in enumerate(rules)}
    return sorted(groups.values(), key=lambda g: (order[g.rule], not g.muon, g.name))


def _accepts(cls: type, keyword: str) -> bool:
    params = inspect.signature(cls.__init__).parameters
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device,
                    log_groups: bool = False) -> torch.optim.Optimizer:
    """The optimizer of `cfg` over `model`'s trainable parameters, its groups resolved by the rules (and μP, where
    `model.args` enables it). Each group's starting `lr` is its base LR, which the schedule multiplies."""
    cls = optimizer_class(cfg.name)
    args = getattr(model, "args", None)
    width_mult = getattr(args, "width_mult", 1.0) if args is not None else 1.0
    if width_mult != 1.0 and cls.__name__ not in ADAPTIVE and cfg.name != "sgd":
        raise ValueError(f"μP (mup.enabled) scales learning rates for Adam-family optimizers, Muon and SGD; it has "
                         f"no rule for optimizer.name {cfg.name!r}")
    resolved = resolve_groups(model, cfg, width_mult)
    groups = []
    for g in resolved:
        group = {"params": g.params, "lr": g.lr, "weight_decay": g.weight_decay, "name": g.name}
        if cfg.name == "muon":
            group["muon"] = g.muon
        groups.append(group)

    kwargs: dict = {"lr": cfg.lr}
    if cfg.name == "muon":
        m = cfg.muon
        kwargs.update(betas=cfg.betas, eps=cfg.eps, momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
                      coefficients=m.coefficients, lr_scaling=m.lr_scaling,
                      momentum_warmup_steps=m.momentum_warmup_steps, momentum_warmup_start=m.momentum_warmup_start,
                      normuon=m.normuon, normuon_beta2=m.normuon_beta2,
                      ns_dtype=None if m.ns_dtype == "auto" else getattr(torch, m.ns_dtype),
                      splits=fused_splits(model))
    else:
        if cfg.name in ("adamw", "adam"):
            kwargs.update(betas=cfg.betas, eps=cfg.eps)
        if cfg.name == "sgd":
            kwargs["momentum"] = cfg.momentum
        if not _accepts(cls, "weight_decay") and any(g["weight_decay"] for g in groups):
            raise ValueError(f"optimizer.name {cfg.name!r} takes no weight_decay: set optimizer.weight_decay = 0")
        impl = cfg.implementation
        params = inspect.signature(cls.__init__).parameters
        if impl == "auto":
            # Fused kernels wherever torch has them: on CPU too, where AdamW's fused step is several times faster
            # than foreach (which is slower than the plain loop there).
            impl = "fused" if "fused" in params and _fused_on(cls, device) else "foreach"
            impl = impl if impl in params else "for-loop"
        if impl in ("fused", "foreach"):
            if impl not in params:
                raise ValueError(f"optimizer.implementation = {impl!r}: {cls.__name__} has no {impl} implementation")
            kwargs[impl] = True
        elif "foreach" in params:
            kwargs["foreach"] = False
    for key, value in cfg.kwargs.items():
        if not _accepts(cls, key):
            raise ValueError(f"optimizer.kwargs.{key}: {cls.__name__} takes no argument {key!r}")
        kwargs[key] = value
    if not _accepts(cls, "weight_decay"):
        for group in groups:
            del group["weight_decay"]
    try:
        optimizer = cls(groups, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"optimizer.name {cfg.name!r}: {cls.__name__}({', '.join(kwargs)}) failed: {e}") from e
    if log_groups:
        log.info("%s; width multiplier %g:\n%s", describe_optimizer(cfg, cls, _accepts(cls, "weight_decay")),
                 width_mult, describe_groups(resolved, cfg.name))
    return optimizer


def describe_optimizer(cfg: OptimizerConfig, cls: type, takes_decay: bool) -> str:
    """One line: the base LRs (Muon's and optimizer.lr apart) and how the weight decay acts."""
    if cfg.name == "muon":
        line = (f"optimizer muon: hidden matrices on Muon at lr {cfg.muon.lr:g} (optimizer.muon.lr), the rest on "
                f"AdamW at lr {cfg.lr:g} (optimizer.lr)")
    else:
        line = f"optimizer {cfg.name} ({cls.__name__}) at lr {cfg.lr:g}"
    decay = cfg.resolved_weight_decay
    if not takes_decay:
        return line + "; no weight decay"
    if cfg.decoupled_decay:
        muon = cfg.muon.weight_decay
        extra = f", {muon:g} on the Muon matrices" if cfg.name == "muon" and muon is not None else ""
        return line + f"; weight decay {decay:g}{extra}, decoupled (AdamW-style); per group below"
    if decay:
        return line + (f"; weight decay {decay:g} as L2 regularisation (added to the gradient, as "
                       f"{cls.__name__} applies it; adamw decouples it)")
    return line + "; no weight decay (L2 in " + cls.__name__ + "; adamw decouples it)"


def _fused_on(cls: type, device: torch.device) -> bool:
    """Whether `auto` takes `cls`'s fused kernel on `device`: torch's own optimizers, on the devices torch has
    fused kernels for (CPU included)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return cls.__module__.startswith("torch.optim") and device.type in _get_fused_kernels_supported_devices()


def fused_splits(model: nn.Module) -> dict[torch.Tensor, tuple[int, ...]]:
    """Fused projections for Muon: a module's `fused_splits = {"weight": (rows, ...)}` marks a parameter whose
    rows hold several logical matrices, each orthogonalised on its own."""
    out = {}
    for module in model.modules():
        for pname, rows in getattr(module, "fused_splits", {}).items():
            p = getattr(module, pname)
            if sum(rows) != p.shape[0]:
                raise ValueError(f"{type(module).__name__}.fused_splits[{pname!r}] = {rows} does not add up to its "
                                 f"{p.shape[0]} rows")
            out[p] = tuple(rows)
    return out


def describe_groups(groups: list[_Group], optimizer: str) -> str:
    """The groups as a table: name, update, LR, LR multiplier, weight decay, tensors, elements, example names."""
    rows = [("group", "update", "lr", "x", "wd", "tensors", "elements", "parameters")]
    for g in groups:
        shown = ", ".join(g.names[:3]) + (f", ... ({len(g.names) - 3} more)" if len(g.names) > 3 else "")
        update = ("muon" if g.muon else "adamw") if optimizer == "muon" else optimizer
        rows.append((g.name, update, f"{g.lr:.3g}", f"{g.lr_multiplier:g}",
                     f"{g.weight_decay:g}", str(len(g.params)), f"{sum(p.numel() for p in g.params):,}", shown))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly distributed one (loss-parallel losses are replicated DTensors)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, scaler: LossScaler | None = None,
                   pp_group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip to `max_norm` by the global L2 norm over all ranks' shards (FSDP, TP) and, with `pp_group`, over the
    pipeline stages (each rank holds its stages' parameters); returns the norm before clipping and, with a loss
    `scaler` (fp16), the overflow flag, after dividing the gradients by the scale.

    Parameters on different meshes (expert parallel's experts beside the dense ones) are normed mesh by mesh and
    the norms combined, as torchtitan's clip_grad_norm_ does for EP: DTensor ops do not mix meshes."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    norms = [full_value(torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True))
             for group in by_mesh.values()] or [torch.nn.utils.get_total_norm([], 2.0)]
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if pp_group is not None:  # torchtitan's clip_grad_norm_ combines the stages' norms the same way
        norm = norm.square()
        torch.distributed.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    overflow = None
    if scaler is not None:
        grads = [[p.grad for p in group] for group in by_mesh.values()] or [[]]
        unscaled = [scaler.unscale(group, norm) for group in grads]  # each group's gradients divided, same norm
        norm, overflow = unscaled[0]
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm, overflow
