"""Muon for hidden matrices and AdamW for everything else, in one optimizer.

Muon (Keller Jordan, 2024) keeps heavy-ball momentum per matrix and replaces the update by its nearest
semi-orthogonal matrix, computed with a few Newton-Schulz iterations:

    B <- mu B + G;   U = G + mu B (Nesterov) or B;   O = NewtonSchulz(U);   p <- p (1 - lr wd) - lr s O

with `s` a shape-dependent scale (`lr_scaling`). Each param group says which update it gets (`"muon": True`
or `False`); AdamW groups get exactly `torch.optim.AdamW`'s update. A fused projection (q, k and v stacked in
one weight) is orthogonalised block by block (`splits`).

Parameters may be plain tensors (one process, or DDP, whose gradients are already averaged) or DTensors
(FSDP2, HSDP, tensor parallel and their combinations). Everything but the orthogonalisation works on each
rank's local piece; see `Muon._orthogonalize` for how the full matrices are formed and spread over ranks.

The state of a parameter lives in `self.state[p]` as tensors, so `torch.distributed.checkpoint` saves and
reshards it like any optimizer's: for Muon `step`, `momentum_buffer` (laid out like `p`) and, with NorMuon,
`normuon_v` (one value per row, the same on every rank); for AdamW `step`, `exp_avg` and `exp_avg_sq`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.adamw import adamw

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


def reference_muon_step(param: Tensor, grad: Tensor, state: dict, *, lr: float, weight_decay: float = 0.0,
                        momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                        lr_scaling: str = "spectral", coefficients: str = "quintic",
                        momentum_warmup_steps: int = 0, momentum_warmup_start: float = 0.85,
                        normuon: bool = False, normuon_beta2: float = 0.95,
                        split: Sequence[int] | None = None, ns_dtype: torch.dtype = torch.float32) -> None:
    """One Muon step of one whole matrix on one process, in place, written to be obviously right (the tests'
    reference). `state` is a plain dict this function owns; `split` lists the row counts of fused matrices."""
    state["step"] = state.get("step", 0) + 1
    mu = momentum_at(state["step"], momentum, momentum_warmup_steps, momentum_warmup_start)
    buf = state.setdefault("momentum_buffer", torch.zeros_like(grad))
    buf.mul_(mu).add_(grad)
    update = grad + mu * buf if nesterov else buf.clone()
    rows, cols = param.shape
    v = state.setdefault("normuon_v", torch.zeros(rows, device=param.device)) if normuon else None
    pieces, start = [], 0
    for size in split or [rows]:
        O = newton_schulz(update[start:start + size], ns_steps, coefficients, ns_dtype).float()
        if v is not None:
            block_v = v[start:start + size]
            block_v.mul_(normuon_beta2).add_((1 - normuon_beta2) * O.square().mean(dim=1))
            normalised = O / (block_v.sqrt() + NORMUON_EPS)[:, None]
            O = normalised * (O.norm() / normalised.norm().clamp_min(NORMUON_EPS))
        pieces.append(shape_scale(size, cols, lr_scaling) * O)
        start += size
    param.mul_(1 - lr * weight_decay)
    param.sub_(lr * torch.cat(pieces).to(param.dtype))


Index = slice | Tensor  # rows or columns of a matrix: a range, or a list of indices (for strided shards)


@dataclass
class _Layout:
    """Where the pieces of one Muon matrix live: for each rank of `group` (in group-rank order), the global rows
    and columns of its local piece and which copy of the matrix it belongs to. A layout shards rows and
    columns independently, so every piece is a row set times a column set."""

    group: dist.ProcessGroup | None  # None: this process holds the matrix whole and alone
    rank: int
    rows: list[Index]
    cols: list[Index]
    copy: list[tuple[int, ...]]

    @property
    def size(self) -> int:
        return len(self.rows)

    def shape(self, rank: int) -> tuple[int, int]:
        return _count(self.rows[rank]), _count(self.cols[rank])

    def region(self, rank: int) -> tuple[Index, Index]:
        """The index of rank `rank`'s piece in the full matrix, for reading and for writing."""
        rows, cols = self.rows[rank], self.cols[rank]
        if isinstance(rows, slice) and isinstance(cols, slice):
            return rows, cols
        device = (rows if isinstance(rows, Tensor) else cols).device
        return _as_ids(rows, device)[:, None], _as_ids(cols, device)


def _as_index(ids: Tensor) -> Index:
    """A range as a slice (a view, no gather), anything else as the index tensor."""
    if not len(ids):
        return slice(0, 0)
    start = int(ids[0])
    if torch.equal(ids, torch.arange(start, start + len(ids), device=ids.device)):
        return slice(start, start + len(ids))
    return ids


def _as_ids(index: Index, device: torch.device) -> Tensor:
    return torch.arange(index.start, index.stop, device=device) if isinstance(index, slice) else index


def _count(index: Index) -> int:
    return index.stop - index.start if isinstance(index, slice) else len(index)


@dataclass
class _Matrix:
    """One Muon parameter being stepped: its group's settings and this rank's piece of the update."""

    param: Tensor
    group: dict
    update: Tensor  # local piece of the momentum update, before orthogonalisation
    layout: _Layout
    splits: tuple[int, ...]
    ns_dtype: torch.dtype


def _is_dtensor(t: Tensor) -> bool:
    # Without torch.distributed.tensor imported there are no DTensors, and one process need not import it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t: Tensor) -> Tensor:
    """This rank's piece of a plain tensor or DTensor (the same storage: in-place changes reach `t`)."""
    return t.to_local() if _is_dtensor(t) else t


def _layout_name(p: Tensor) -> str:
    if _is_dtensor(p):
        return f"DTensor {tuple(p.placements)} over mesh {p.device_mesh}"
    return "plain tensor"


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `"muon": True` (2-D parameters only), AdamW for those with `"muon": False`.

    Keyword arguments are the defaults of every group; a group may override any of them. Muon groups use
    `lr`, `weight_decay`, `momentum`, `nesterov`, `ns_steps`, `lr_scaling`, `momentum_warmup_steps`,
    `momentum_warmup_start`, `normuon`, `normuon_beta2`; AdamW groups use `lr`, `weight_decay`, `betas`,
    `eps`, `foreach`, `fused` (passed to torch's AdamW function). For the whole optimizer: `coefficients`
    (`quintic` or `polar_express`), `ns_dtype` (the Newton-Schulz precision; None: bfloat16 on CUDA, float32
    elsewhere) and `splits`, mapping a fused parameter to the row counts of the matrices stacked in it.
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
        self._layouts: dict[Tensor, _Layout] = {}  # built on first use; not state: the layout is the model's
        self._groups: dict[Any, dist.ProcessGroup] = {}

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
        layout = self._layout(p)
        if _layout_name(grad) != _layout_name(p):
            raise ValueError(f"Muon: the gradient of a parameter of shape {tuple(p.shape)} is laid out as "
                             f"{_layout_name(grad)}, unlike the parameter ({_layout_name(p)})")
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["normuon"]:  # one running mean square per row, the same on every rank
                state["normuon_v"] = torch.zeros(p.shape[0], dtype=torch.float32, device=_local(p).device)
        if group["normuon"] and "normuon_v" not in state:
            raise ValueError(f"Muon: a parameter of shape {tuple(p.shape)} has NorMuon on but no 'normuon_v' state "
                             f"(was the optimizer state loaded from a run without NorMuon?)")
        if state["step"].device.type != "cpu":  # a fused AdamW setting moved it on load; keep reading it cheap
            state["step"] = state["step"].cpu()
        state["step"] += 1
        mu = momentum_at(int(state["step"]), group["momentum"], group["momentum_warmup_steps"],
                         group["momentum_warmup_start"])
        g, buf = _local(grad), _local(state["momentum_buffer"])
        buf.mul_(mu).add_(g)
        update = g.add(buf, alpha=mu) if group["nesterov"] else buf
        ns_dtype = self.ns_dtype or (torch.bfloat16 if update.device.type == "cuda" else torch.float32)
        return _Matrix(p, group, update, layout, self.splits.get(p, (p.shape[0],)), ns_dtype)

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
        p = _local(m.param)
        p.mul_(1 - lr * group["weight_decay"])
        p.add_((piece.float() * factor[m.layout.rows[m.layout.rank]][:, None]).to(p.dtype), alpha=-lr)

    # -- the orthogonalisation, over however many ranks hold the matrices ------------------------------------

    def _orthogonalize(self, matrices: list[_Matrix]) -> list[tuple[Tensor, Tensor | None]]:
        """Newton-Schulz of every matrix's update; for each, this rank's piece of the result and, with NorMuon,
        the sums of squares of the result's rows (all rows).

        Scheme: the matrices held by the same set of ranks are dealt round-robin to those ranks (matrix j of
        the set to group rank j mod n). One all-to-all sends each owner the pieces of its matrices from the
        ranks of one copy of each (the owner's own copy: its FSDP shard group under HSDP, only itself for a
        replicated matrix); the owner reassembles and orthogonalises them, and a second all-to-all sends every
        rank its piece of each result. Each rank thus orthogonalises about 1/n of the matrices and sends and
        receives about its share of them twice. One process holding its matrices whole does the same locally.
        """
        results: list[tuple[Tensor, Tensor | None] | None] = [None] * len(matrices)
        by_group: dict[Any, list[int]] = {}
        for i, m in enumerate(matrices):
            by_group.setdefault(m.layout.group, []).append(i)
        for indices in by_group.values():
            for i, result in zip(indices, self._orthogonalize_group([matrices[i] for i in indices])):
                results[i] = result
        return results  # type: ignore[return-value]

    def _orthogonalize_group(self, matrices: list[_Matrix]) -> list[tuple[Tensor, Tensor | None]]:
        layout0 = matrices[0].layout
        n, me = layout0.size, layout0.rank
        device = matrices[0].update.device
        owner = [j % n for j in range(len(matrices))]
        mine = [j for j in range(len(matrices)) if owner[j] == me]

        # 1. Pieces of each update to their owner, from the ranks of the owner's copy of the matrix.
        sends = [[m.update.to(m.ns_dtype) for j, m in enumerate(matrices)
                  if owner[j] == dst and m.layout.copy[dst] == m.layout.copy[me]] for dst in range(n)]
        specs = [[(m.layout.shape(src), m.ns_dtype) for m in (matrices[j] for j in mine)
                  if m.layout.copy[src] == m.layout.copy[me]] for src in range(n)]
        received = _all_to_all(sends, specs, layout0.group, device)
        pieces_from = [iter(r) for r in received]

        # 2. Reassemble and orthogonalise this rank's matrices.
        outputs: dict[int, tuple[Tensor, Tensor | None]] = {}
        for j in mine:
            m = matrices[j]
            full = torch.empty(m.param.shape, dtype=m.ns_dtype, device=device)
            for src in range(n):
                if m.layout.copy[src] == m.layout.copy[me]:
                    full[m.layout.region(src)] = next(pieces_from[src])
            blocks = torch.split(full, list(m.splits))
            O = torch.cat([newton_schulz(b, m.group["ns_steps"], self.coefficients, m.ns_dtype) for b in blocks])
            outputs[j] = O, (O.float().square().sum(dim=1) if m.group["normuon"] else None)

        # 3. Every rank its piece of each result (and, for NorMuon, the row sums of squares of all rows).
        sends = []
        for dst in range(n):
            out = []
            for j in mine:
                O, row_sumsq = outputs[j]
                out.append(O[matrices[j].layout.region(dst)])
                if row_sumsq is not None:
                    out.append(row_sumsq)
            sends.append(out)
        specs = []
        for src in range(n):
            spec = []
            for j, m in enumerate(matrices):
                if owner[j] == src:
                    spec.append((m.layout.shape(me), m.ns_dtype))
                    if m.group["normuon"]:
                        spec.append(((m.param.shape[0],), torch.float32))
            specs.append(spec)
        received = [iter(r) for r in _all_to_all(sends, specs, layout0.group, device)]
        results = []
        for j, m in enumerate(matrices):
            piece = next(received[owner[j]])
            results.append((piece, next(received[owner[j]]) if m.group["normuon"] else None))
        return results

    def _layout(self, p: Tensor) -> _Layout:
        if p not in self._layouts:
            self._layouts[p] = self._build_layout(p)
        return self._layouts[p]

    def _build_layout(self, p: Tensor) -> _Layout:
        rows, cols = p.shape
        device = _local(p).device
        if not _is_dtensor(p):
            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                return _Layout(None, 0, [slice(0, rows)], [slice(0, cols)], [()])
            # Plain tensors across processes: DDP, every rank a whole copy with the same averaged gradient.
            group, mine = dist.group.WORLD, (torch.arange(rows), torch.arange(cols), (dist.get_rank(),))
        else:
            from torch.distributed.tensor import distribute_tensor

            mesh, placements = p.device_mesh, p.placements
            if any(pl.is_partial() for pl in placements):
                raise ValueError(f"Muon: a parameter of shape {(rows, cols)} is laid out as {_layout_name(p)}; "
                                 f"a partial (unreduced) matrix cannot be orthogonalised")
            group = self._mesh_group(mesh)
            # This rank's rows: lay out a (rows x n) tensor of row numbers the way `p` is laid out (no
            # communication); n columns leave every column shard non-empty. The same for the columns.
            n = mesh.size()
            row_ids = torch.arange(rows)[:, None].expand(rows, n)
            col_ids = torch.arange(cols)[None, :].expand(n, cols)
            local_rows = distribute_tensor(row_ids, mesh, placements, src_data_rank=None).to_local()[:, 0]
            local_cols = distribute_tensor(col_ids, mesh, placements, src_data_rank=None).to_local()[0, :]
            copy = tuple(c for c, pl in zip(mesh.get_coordinate(), placements) if pl.is_replicate())
            mine = (local_rows.cpu(), local_cols.cpu(), copy)
            if tuple(p.to_local().shape) != (len(mine[0]), len(mine[1])):
                raise ValueError(f"Muon: cannot place the local piece {tuple(p.to_local().shape)} of a parameter "
                                 f"of shape {(rows, cols)} laid out as {_layout_name(p)}")
        if "nccl" in str(dist.get_backend(group)) and device.type != "cuda":
            raise ValueError(f"Muon: a parameter of shape {(rows, cols)} ({_layout_name(p)}) is on {device}, but its "
                             f"ranks talk over NCCL; CPU-offloaded parameters are not handled by Muon")
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        return _Layout(group, dist.get_rank(group), [_as_index(e[0].to(device)) for e in everyone],
                       [_as_index(e[1].to(device)) for e in everyone], [e[2] for e in everyone])

    def _mesh_group(self, mesh) -> dist.ProcessGroup:
        """The process group of all ranks of `mesh` (flattened, for a mesh of more than one dimension)."""
        if mesh not in self._groups:
            self._groups[mesh] = (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()
        return self._groups[mesh]


def _all_to_all(sends: list[list[Tensor]], specs: list[list[tuple[tuple[int, ...], torch.dtype]]],
                group: dist.ProcessGroup | None, device: torch.device) -> list[list[Tensor]]:
    """Send `sends[r]` (tensors) to group rank r and receive from each rank s tensors of the shapes and dtypes
    `specs[s]`, in one all-to-all of bytes. Without a group (one process) the sends are the receipts."""
    if group is None:
        return [[t.reshape(shape) for t, (shape, _) in zip(sends[0], specs[0])]]
    send_bytes = [torch.cat([_as_bytes(t) for t in ts]) if ts else torch.empty(0, dtype=torch.uint8, device=device)
                  for ts in sends]
    recv_sizes = [sum(_padded_nbytes(shape, dtype) for shape, dtype in spec) for spec in specs]
    output = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(output, torch.cat(send_bytes), recv_sizes, [len(b) for b in send_bytes], group=group)
    received, offset = [], 0
    for spec in specs:
        tensors = []
        for shape, dtype in spec:
            nbytes = math.prod(shape) * dtype.itemsize
            tensors.append(output[offset:offset + nbytes].view(dtype).reshape(shape))
            offset += _padded_nbytes(shape, dtype)
        received.append(tensors)
    return received


# Each tensor's bytes start at a multiple of 8, so that every received tensor can be viewed in its dtype.
_ALIGN = 8


def _padded_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    nbytes = math.prod(shape) * dtype.itemsize
    return nbytes + (-nbytes) % _ALIGN


def _as_bytes(t: Tensor) -> Tensor:
    data = t.contiguous().reshape(-1).view(torch.uint8)
    pad = (-len(data)) % _ALIGN
    return torch.cat([data, data.new_zeros(pad)]) if pad else data
