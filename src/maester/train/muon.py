"""Muon for hidden matrices and AdamW for everything else, in one optimizer.

Muon (Keller Jordan, 2024) keeps heavy-ball momentum per matrix and replaces the update by its nearest
semi-orthogonal matrix, computed with a few Newton-Schulz iterations:

    B <- mu B + G;   U = G + mu B (Nesterov) or B;   O = NewtonSchulz(U);   p <- p (1 - lr wd) - lr s O

with `s` a shape-dependent scale (`lr_scaling`). Each param group says which update it gets (`"muon": True`
or `False`); AdamW groups get exactly `torch.optim.AdamW`'s update. A fused projection (q, k and v stacked in
one weight) is orthogonalised block by block (`splits`).

Parameters may be plain tensors (one process, or DDP, whose gradients are already averaged) or DTensors
(FSDP2, HSDP, tensor parallel and their combinations). Everything but the orthogonalisation works on each
rank's local piece; `maester.train.muon_sharding` forms the full matrices and spreads them over ranks.

The state of a parameter lives in `self.state[p]` as tensors, so `torch.distributed.checkpoint` saves and
reshards it like any optimizer's: for Muon `step`, `momentum_buffer` (laid out like `p`) and, with NorMuon,
`normuon_v` (one value per row, the same on every rank); for AdamW `step`, `exp_avg` and `exp_avg_sq`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from maester.gpu_defaults import resolves_as
from maester.train.muon_sharding import Layouts, ShardedMatrix, layout_name, local, work_on_whole

# The quintic of the modded-nanogpt speedruns: it pushes every singular value of a normalised matrix into
# roughly [0.7, 1.1] in five steps instead of converging to exactly 1, which is all Muon needs.
QUINTIC = (3.4445, -4.7750, 2.0315)

# Polar Express (N. Amsel, D. Persson, C. Musco, R. M. Gower, "The Polar Express: Optimal Matrix Sign Methods
# and Their Application to the Muon Algorithm", 2025, arXiv:2505.16932): a different minimax-optimal quintic
# for each iteration. These are the five used in the modded-nanogpt speedruns, derived with a safety factor
# of 2e-2, so the input is scaled by 1 / (1.02 |X|_F) rather than 1 / |X|_F. Further steps repeat the last.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02

COEFFICIENTS = ("quintic", "polar_express")
LR_SCALINGS = ("spectral", "match_adamw", "none")
NORMUON_EPS = 1e-10


def newton_schulz(U: Tensor, steps: int, coefficients: str = "quintic",
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """An approximation of U's orthogonal polar factor (`A B^T` for U's SVD `A S B^T`), returned in `dtype`."""
    if U.ndim != 2:
        raise ValueError(f"newton_schulz takes a matrix, got a tensor of shape {tuple(U.shape)}")
    if coefficients == "quintic":
        schedule, safety = [QUINTIC] * steps, 1.0
    elif coefficients == "polar_express":
        schedule = [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]
        safety = POLAR_EXPRESS_SAFETY
    else:
        raise ValueError(f"coefficients {coefficients!r}: expected one of {', '.join(COEFFICIENTS)}")
    X = U.to(dtype)
    transposed = X.shape[0] > X.shape[1]
    if transposed:  # iterate on the wide orientation, so that X X^T is the smaller Gram matrix
        X = X.T
    X = X / (X.norm() * safety + 1e-7)  # the spectral norm is at most the Frobenius norm: now <= 1
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if transposed else X


def shape_scale(rows: int, cols: int, lr_scaling: str) -> float:
    """The factor on one (logical) matrix's orthogonalised update."""
    if lr_scaling == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if lr_scaling == "match_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if lr_scaling == "none":
        return 1.0
    raise ValueError(f"lr_scaling {lr_scaling!r}: expected one of {', '.join(LR_SCALINGS)}")


def momentum_at(step: int, momentum: float, warmup_steps: int, warmup_start: float) -> float:
    """The momentum of optimizer step `step` (1 for the first): `warmup_start` at step 1, rising linearly to
    `momentum` at step `warmup_steps + 1` and staying there."""
    if warmup_steps == 0:
        return momentum
    frac = min(1.0, (step - 1) / warmup_steps)
    return warmup_start + frac * (momentum - warmup_start)


@dataclass
class _Matrix:
    """One Muon parameter being stepped: its group's settings, its blocks, and this rank's piece of the update."""

    param: Tensor
    group: dict
    splits: tuple[int, ...]
    update: ShardedMatrix  # this rank's piece of the momentum update, before orthogonalisation


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `"muon": True` (2-D parameters only), AdamW for those with `"muon": False`.

    Keyword arguments are the defaults of every group; a group may override any of them. Muon groups use
    `lr`, `weight_decay`, `momentum`, `nesterov`, `ns_steps`, `lr_scaling`, `momentum_warmup_steps`,
    `momentum_warmup_start`, `normuon`, `normuon_beta2`; AdamW groups use `lr`, `weight_decay`, `betas`,
    `eps`, `foreach`, `fused` (passed to torch's AdamW function). For the whole optimizer: `coefficients`
    (`quintic` or `polar_express`), `ns_dtype` (the Newton-Schulz precision; None: bfloat16 on CUDA, float32
    elsewhere, as `maester.gpu_defaults.resolves_as` says) and `splits`, mapping a fused parameter to the row counts of the matrices stacked in it.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *, lr: float = 0.02,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 lr_scaling: str = "spectral", momentum_warmup_steps: int = 0,
                 momentum_warmup_start: float = 0.85, normuon: bool = False, normuon_beta2: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, foreach: bool | None = None,
                 fused: bool | None = None, coefficients: str = "quintic", ns_dtype: torch.dtype | None = None,
                 splits: dict[Tensor, tuple[int, ...]] | None = None):
        if coefficients not in COEFFICIENTS:
            raise ValueError(f"Muon: coefficients {coefficients!r}: expected one of {', '.join(COEFFICIENTS)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        lr_scaling=lr_scaling, momentum_warmup_steps=momentum_warmup_steps,
                        momentum_warmup_start=momentum_warmup_start, normuon=normuon, normuon_beta2=normuon_beta2,
                        betas=betas, eps=eps, foreach=foreach, fused=fused)
        super().__init__(params, defaults)
        self.coefficients = coefficients
        self.ns_dtype = ns_dtype
        self.splits = self._check_splits(splits or {})
        self._layouts = Layouts()  # not state: the layout is the model's

    # -- construction checks -------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        name = param_group.get("name", f"#{len(self.param_groups)}")
        if "muon" not in param_group:
            raise ValueError(f"Muon: param group {name} has no 'muon' key (True: Muon update, False: AdamW)")
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], name)
        except ValueError:
            self.param_groups.pop()
            raise

    @staticmethod
    def _check_group(group: dict, name: str) -> None:
        if not isinstance(group["muon"], bool):
            raise ValueError(f"Muon: param group {name}: 'muon' must be True or False, got {group['muon']!r}")
        if not group["muon"]:
            return
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"Muon: param group {name} uses the Muon update, which takes 2-D matrices only, "
                                 f"but holds a parameter of shape {tuple(p.shape)}; put it in an AdamW group "
                                 f"('muon': False)")
        if group["lr_scaling"] not in LR_SCALINGS:
            raise ValueError(f"Muon: param group {name}: lr_scaling {group['lr_scaling']!r}: expected one of "
                             f"{', '.join(LR_SCALINGS)}")
        if group["ns_steps"] < 1:
            raise ValueError(f"Muon: param group {name}: ns_steps must be at least 1, got {group['ns_steps']}")

    def _check_splits(self, splits: dict[Tensor, tuple[int, ...]]) -> dict[Tensor, tuple[int, ...]]:
        # A split is a fact about the model; on a parameter of an AdamW group (elementwise updates) it is unused.
        params = {p for g in self.param_groups for p in g["params"]}
        for p, rows in splits.items():
            if p not in params:
                raise ValueError(f"Muon: splits name a parameter of shape {tuple(p.shape)} that is in no param "
                                 f"group of this optimizer")
            if not rows or any(r <= 0 for r in rows) or sum(rows) != p.shape[0]:
                raise ValueError(f"Muon: splits {tuple(rows)} for a parameter of shape {tuple(p.shape)} must be "
                                 f"positive row counts summing to {p.shape[0]}")
        return {p: tuple(rows) for p, rows in splits.items()}

    # -- the step ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every matrix's layout at once on the first step: one object gather per process group, not per matrix.
        self._layouts.build([p for g in self.param_groups if g["muon"] for p in g["params"] if p.grad is not None])
        matrices: list[_Matrix] = []
        for group in self.param_groups:
            if group["muon"]:
                matrices += [self._momentum_update(p, group) for p in group["params"] if p.grad is not None]
            else:
                self._adamw_step(group)
        results = self._orthogonalize(matrices)
        for m, (piece, row_sumsq) in zip(matrices, results):
            self._apply(m, piece, row_sumsq)
        return loss

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                on_device = bool(group["fused"])  # fused kernels want the step count beside the parameter
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"], fused=group["fused"],
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)

    def _momentum_update(self, p: Tensor, group: dict) -> _Matrix:
        """Advance the momentum of `p` (on this rank's piece) and return the piece of the update to orthogonalise."""
        grad = p.grad
        layout = self._layouts.of(p)
        if layout_name(grad) != layout_name(p):
            raise ValueError(f"Muon: the gradient of a parameter of shape {tuple(p.shape)} is laid out as "
                             f"{layout_name(grad)}, unlike the parameter ({layout_name(p)})")
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["normuon"]:  # one running mean square per row, the same on every rank
                state["normuon_v"] = torch.zeros(p.shape[0], dtype=torch.float32, device=local(p).device)
        if group["normuon"] and "normuon_v" not in state:
            raise ValueError(f"Muon: a parameter of shape {tuple(p.shape)} has NorMuon on but no 'normuon_v' state "
                             f"(was the optimizer state loaded from a run without NorMuon?)")
        if state["step"].device.type != "cpu":  # a fused AdamW setting moved it on load; keep reading it cheap
            state["step"] = state["step"].cpu()
        state["step"] += 1
        mu = momentum_at(int(state["step"]), group["momentum"], group["momentum_warmup_steps"],
                         group["momentum_warmup_start"])
        g, buf = local(grad), local(state["momentum_buffer"])
        buf.mul_(mu).add_(g)
        update = g.add(buf, alpha=mu) if group["nesterov"] else buf
        ns_dtype = self.ns_dtype or (torch.bfloat16 if resolves_as(update.device.type) == "cuda" else torch.float32)
        return _Matrix(p, group, self.splits.get(p, (p.shape[0],)),
                       ShardedMatrix(update, tuple(p.shape), layout, ns_dtype, row_values=group["normuon"]))

    def _apply(self, m: _Matrix, piece: Tensor, row_sumsq: Tensor | None) -> None:
        """Scale this rank's piece of the orthogonalised update row by row and apply it with weight decay."""
        group, (rows, cols) = m.group, m.param.shape
        factor = torch.empty(rows, dtype=torch.float32, device=piece.device)
        v = self.state[m.param]["normuon_v"] if group["normuon"] else None
        start = 0
        for size in m.splits:
            block = slice(start, start + size)
            f = torch.full((size,), shape_scale(size, cols, group["lr_scaling"]), device=piece.device)
            if v is not None:
                # NorMuon: divide each row by its running RMS, then restore the block's Frobenius norm.
                beta2, q = group["normuon_beta2"], row_sumsq[block]
                v[block] = beta2 * v[block] + (1 - beta2) * (q / cols)
                inv_rms = 1 / (v[block].sqrt() + NORMUON_EPS)
                norm_after = (q * inv_rms.square()).sum().sqrt().clamp_min(NORMUON_EPS)
                f = f * inv_rms * (q.sum().sqrt() / norm_after)
            factor[block] = f
            start += size
        lr = float(group["lr"])
        p, layout = local(m.param), m.update.layout
        p.mul_(1 - lr * group["weight_decay"])
        p.add_((piece.float() * factor[layout.rows[layout.rank]][:, None]).to(p.dtype), alpha=-lr)

    # -- the orthogonalisation, over however many ranks hold the matrices ------------------------------------

    def _orthogonalize(self, matrices: list[_Matrix]) -> list[tuple[Tensor, Tensor | None]]:
        """Newton-Schulz of every matrix's update (block by block for a fused one), each on one of the ranks
        holding it (`muon_sharding.work_on_whole`); for each, this rank's piece of the result and, with NorMuon,
        the sums of squares of the result's rows (all rows)."""

        def orthogonalize(j: int, full: Tensor) -> tuple[Tensor, Tensor | None]:
            m = matrices[j]
            blocks = torch.split(full, list(m.splits))
            O = torch.cat([newton_schulz(b, m.group["ns_steps"], self.coefficients, m.update.dtype) for b in blocks])
            return O, (O.float().square().sum(dim=1) if m.group["normuon"] else None)

        return work_on_whole([m.update for m in matrices], orthogonalize)
