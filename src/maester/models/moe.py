"""The mixture-of-experts feed-forward (`TransformerArgs.moe`): a router picks each token's top-k experts (token
choice), the experts run on their tokens with no capacity limit (dropless), and their outputs come back weighted
by the gates; shared experts, where there are any, see every token.

Experts' weights are stacked, one (n_experts, out, in) parameter per projection, in `nn.Linear`'s orientation.
Tokens are sorted by expert and run as one grouped GEMM (`torch._grouped_mm`) where torch has a grouped kernel for
the device (`grouped_mm_fast_path`: NVIDIA SM90/SM100 in bf16), else as a loop over the experts, which runs
anywhere and needs the group sizes on the host: expert parallel has them already (one read with its split sizes),
otherwise the loop reads them once per layer. On other GPUs (A100, MI250X, MI300X unless torch's CK path is
enabled) `torch._grouped_mm` itself would loop, reading its offsets on the host in every call: three times in a
layer's forward, six in its backward.

Balancing: the load-balancing loss and the router z-loss are kept on the module after each training forward
(`aux_loss`, coefficients applied) for the model to add to its loss; the auxiliary-loss-free bias (DeepSeek-V3)
is moved by `update_expert_bias` after each optimizer step. The load and the losses are also summed into small
device buffers that `moe_metrics` reads on logging steps only.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from maester.models.args import MoEArgs
from maester.models.layers import GatedMLP


def _in_backward() -> bool:
    """Whether autograd is running (activation checkpointing recomputing a forward): such a forward is not counted
    twice in the load."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Token-choice top-k routing: logits -> scores (softmax or sigmoid) -> the top-k experts by score plus the
    selection bias, whose gate weights are their scores (renormalised with `norm_topk_prob`)."""

    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.n_experts, bias=False)
        # Used only to choose experts; a state of training (checkpointed), moved by `update_expert_bias`.
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts), persistent=moe.bias_balancing > 0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> logits (tokens, E, fp32), scores (tokens, E), weights (tokens, k), indices
        (tokens, k)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.moe.gate == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias if self.moe.bias_balancing > 0 else scores
        indices = biased.topk(self.moe.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, weights, indices


class GroupedExperts(nn.Module):
    """n_experts gated MLPs, their weights stacked: gate_proj and up_proj (E, hidden, dim), down_proj (E, dim,
    hidden). `dispatch`: `auto` (grouped GEMM where it runs, see `grouped_mm_supported`), `grouped` or `loop`."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, activation: str):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.dispatch = "auto"

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x) if self.activation == "silu" else F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None = None) -> torch.Tensor:
        """x (tokens, dim) sorted by expert, `counts[e]` of them for expert e -> (tokens, dim). `host_counts`: the
        same counts on the host where the caller has them (expert parallel), for the loop."""
        dtype = _compute_dtype(x)
        weights = [_local(p) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        grouped = self.dispatch == "grouped" or (self.dispatch == "auto" and grouped_mm_supported(x, weights[2]))
        if grouped:
            return self._grouped(x.to(dtype), counts, weights)
        return self._loop(x, counts if host_counts is None else host_counts, weights)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """One grouped GEMM per projection, in x's dtype (autocast does not cover `_grouped_mm`)."""
        offs = counts.cumsum(0).to(torch.int32)
        w = [p.to(x.dtype).transpose(-2, -1) for p in weights]
        gate = torch._grouped_mm(x, w[0], offs=offs)
        up = torch._grouped_mm(x, w[1], offs=offs)
        return torch._grouped_mm(self._act(gate) * up, w[2], offs=offs)

    @torch.compiler.disable
    def _loop(self, x: torch.Tensor, counts: torch.Tensor | list[int], weights: list[torch.Tensor]) -> torch.Tensor:
        """Expert by expert, with the group sizes on the host (`counts` read here if a tensor). Eager under compile,
        the host read too: each new set of sizes (a group of 0 or 1 rows, then any other) recompiled the block
        until dynamo's cache limit, for a fusion of one activation."""
        if isinstance(counts, torch.Tensor):
            counts = group_sizes([counts], [x.shape[0]])[0]
        gate_proj, up_proj, down_proj = weights
        outs = []
        for e, chunk in enumerate(x.split(counts)):
            h = self._act(F.linear(chunk, gate_proj[e])) * F.linear(chunk, up_proj[e])
            outs.append(F.linear(h, down_proj[e]))
        return torch.cat(outs)


_BALANCED = False  # set by `balanced_routing`


@contextlib.contextmanager
def balanced_routing():
    """While on, `group_sizes` gives the sizes balanced routing would, without reading the tensor: for a memory plan
    on fake tensors (`maester.plan`), which have shapes but no values to read back."""
    global _BALANCED
    before, _BALANCED = _BALANCED, True
    try:
        yield
    finally:
        _BALANCED = before


def group_sizes(parts: list[torch.Tensor], totals: list[int]) -> list[list[int]]:
    """The 1-D count tensors `parts` on the host, in one device read; part i sums to `totals[i]`. Under
    `balanced_routing`, each total split over its part as evenly as balanced routing splits it, without the read."""
    if _BALANCED:
        return [[total // p.numel() + (i < total % p.numel()) for i in range(p.numel())]
                for p, total in zip(parts, totals)]
    flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    starts = [sum(p.numel() for p in parts[:i]) for i in range(len(parts) + 1)]
    return [flat[a:b] for a, b in zip(starts, starts[1:])]


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert weight sharded from outside (expert or tensor parallel: a DTensor), the
    weight itself otherwise."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on x run in: autocast's where it is on for x's device, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


GROUPED_MM_CUDA_MAJORS = (9, 10)
"""Compute capabilities (major) where `torch._grouped_mm` has its grouped bf16 kernel: SM90 (H100, H200, GH200)
and SM100 (B200, GB200, B300). torch 2.10 to 2.15, aten/src/ATen/native/cuda/GroupedBlas.cpp `_grouped_mm_cuda`:
`_scaled_mm_allowed_device(sm90_only, sm100_only)`, i.e. major 9 or 10; every other GPU (A100 SM80, L40S SM89,
RTX 50 SM120, Thor SM110) runs `_grouped_mm_fallback`."""

GROUPED_MM_ROCM_ARCHS = ("gfx942", "gfx950")
"""ROCm architectures (MI300X/MI325X, MI355X) where `torch._grouped_mm` runs composable_kernel's grouped GEMM, and
only with ROCM_ALLOW_GROUP_GEMM_CK=1 (opt-in since torch 2.10: pytorch#170159, #171140) in a build with CK GEMM;
otherwise, and always on gfx90a (MI250X: not in torch 2.10's list, and composable_kernel#3336 turned its CK Tile
grouped GEMM off), the fallback."""


def grouped_mm_fast_path(capability: tuple[int, int] | None, arch: str | None,
                         env: dict[str, str] | None = None) -> bool:
    """Whether `torch._grouped_mm` takes its grouped kernel on a GPU of this compute `capability` (NVIDIA) or ROCm
    `arch` (`gcnArchName`, such as "gfx90a:sramecc+:xnack-"), in bf16; elsewhere it runs `_grouped_mm_fallback`,
    which reads the offsets on the host in every call (`offs.cpu()`, aten/src/ATen/native/GroupedMMUtils.h) and
    loops over the groups. `env`: the environment (default: this process's)."""
    if arch:
        env = os.environ if env is None else env
        opted_in = env.get("ROCM_ALLOW_GROUP_GEMM_CK", "").strip().lower() in ("1", "true")
        return opted_in and arch.split(":")[0] in GROUPED_MM_ROCM_ARCHS
    return capability is not None and capability[0] in GROUPED_MM_CUDA_MAJORS


@functools.cache
def _fast_path_on(device: torch.device) -> bool:
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") if torch.version.hip else None
    return grouped_mm_fast_path(torch.cuda.get_device_capability(device), arch)


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the experts run as one `torch._grouped_mm` here: a GPU where it has its grouped kernel
    (`grouped_mm_fast_path`), computing in bf16 (weights cast, so fp32 weights under bf16 autocast qualify), rows
    16-byte aligned. Elsewhere the loop is cheaper than torch's own fallback (one host read a layer, or none under
    expert parallel, against one per GEMM call). On CPU recent torch runs the forward but not the backward."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and _compute_dtype(x) == torch.bfloat16
            and all(n % 8 == 0 for n in weight.shape[1:]) and _fast_path_on(x.device))


class MoEFeedForward(nn.Module):
    """The routed experts plus the shared ones. After a training forward, `aux_loss` holds this layer's weighted
    load-balancing and z-losses (a scalar with gradient; zero when both coefficients are)."""

    def __init__(self, dim: int, moe: MoEArgs, activation: str):
        super().__init__()
        self.moe = moe
        self.router = Router(dim, moe)
        self.experts = GroupedExperts(dim, moe.expert_hidden_dim, moe.n_experts, activation)
        self.shared_experts = (GatedMLP(dim, moe.n_shared_experts * moe.expert_hidden_dim, activation)
                               if moe.n_shared_experts else None)
        # Routed assignments per expert since the last bias update (for `update_expert_bias`).
        self.register_buffer("load", torch.zeros(moe.n_experts), persistent=False)
        # Since the last logging step: assignments per expert, and [load-balancing loss, z-loss, forwards] summed.
        self.register_buffer("window_load", torch.zeros(moe.n_experts), persistent=False)
        self.register_buffer("window_losses", torch.zeros(3), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def reset_state(self) -> None:
        """Zero the selection bias and the counters (after materialising from the meta device)."""
        for buffer in (self.router.expert_bias, self.load, self.window_load, self.window_losses):
            buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, scores, weights, indices = self.router(x)
        flat = indices.reshape(-1)
        order = flat.argsort(stable=True)
        # Not bincount: on CUDA it reads the indices' max back to the host (a sync per MoE layer).
        counts = flat.new_zeros(self.moe.n_experts).scatter_add_(0, flat, torch.ones_like(flat))
        token = order // self.moe.top_k
        routed = self.experts(x[token], counts)
        routed = routed * weights.reshape(-1)[order, None].to(routed.dtype)
        out = torch.zeros_like(x).index_add_(0, token, routed.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.training:
            self._balance(logits, scores, counts)
        return out.reshape(shape)

    def _balance(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor) -> None:
        """Set `aux_loss` and add to the load and loss counters (not when a checkpointed forward is recomputed)."""
        balance = load_balancing_loss(scores, counts)
        z = router_z_loss(logits)
        self.aux_loss = self.moe.aux_loss_coef * balance + self.moe.z_loss_coef * z
        if _in_backward():
            return
        with torch.no_grad():
            self.load += counts
            self.window_load += counts
            self.window_losses += torch.stack([balance.detach(), z.detach(), torch.ones_like(z)])


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e * P_e (Switch Transformer, in Hugging Face's scale): f_e the routed assignments of expert e per
    token (no gradient; they sum to top_k), P_e the mean over tokens of e's score, normalised per token for
    sigmoid scores. top_k when balanced, up to E * top_k when every token picks the same experts; the same value as
    HF's `load_balancing_loss_func` for one layer, so `router_aux_loss_coef` maps to `aux_loss_coef` unchanged."""
    n_experts = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True)
    share = counts.float() / scores.shape[0]
    return n_experts * (share * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean over tokens of logsumexp(logits)^2 (ST-MoE): keeps router logits small."""
    return logits.logsumexp(-1).square().mean()


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The mean over MoE layers of their `aux_loss` from the last training forward (None without one), then
    cleared: a mean, as megablocks (OLMoE) and HF (which pools the layers' router logits) do, so a coefficient
    means the same at any depth."""
    losses = []
    for layer in moe_layers(model):
        if layer.aux_loss is not None:
            losses.append(layer.aux_loss)
            layer.aux_loss = None
    return torch.stack(losses).mean() if losses else None


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> None:
    """Auxiliary-loss-free balancing, after an optimizer step: each layer's selection bias moves by
    `bias_balancing` toward balance, +rate for an expert under the mean load and -rate over it (DeepSeek-V3),
    centred so the biases do not drift together; the load counters restart. `group`: the data-parallel group over
    which the load is summed first (every rank then moves its bias the same way). No host read."""
    for layer in moe_layers(model):
        rate = layer.moe.bias_balancing
        if rate > 0:
            load = layer.load
            if group is not None:
                torch.distributed.all_reduce(load, group=group)
            delta = rate * torch.sign(load.mean() - load)
            layer.router.expert_bias += delta - delta.mean()
        layer.load.zero_()


def moe_metrics(model: nn.Module, group=None) -> dict[str, float]:
    """Per MoE layer since the last call: the expert load as min and max over experts of its share divided by the
    balanced share 1/E (1 and 1 when balanced), its entropy in nats over log(E) (1 when balanced), and the mean
    load-balancing (top_k when balanced) and z-losses (unweighted, means over ranks' forwards); the counters restart. `group`: the
    data-parallel group the counters are summed over (a collective: every rank calls it). One host read."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        return {}
    sums = torch.stack([torch.cat([m.window_load, m.window_losses]) for _, m in layers])
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    rows = sums.tolist()
    out = {}
    for (name, m), row in zip(layers, rows):
        n = m.moe.n_experts
        total, (balance, z, forwards) = max(sum(row[:n]), 1.0), row[n:]
        share = [c / total for c in row[:n]]
        entropy = -sum(p * math.log(p) for p in share if p > 0)
        key = "moe/" + name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        key = key.removesuffix(".feed_forward")
        out.update({f"{key}/load_min": min(share) * n, f"{key}/load_max": max(share) * n,
                    f"{key}/load_entropy": entropy / math.log(n),
                    f"{key}/balance_loss": balance / max(forwards, 1), f"{key}/z_loss": z / max(forwards, 1)})
        m.window_load.zero_()
        m.window_losses.zero_()
    return out
