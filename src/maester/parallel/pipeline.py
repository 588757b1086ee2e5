"""Pipeline parallel (`parallel.pp`) with `torch.distributed.pipelining`, after torchtitan's
distributed/pipeline_parallel.py (`_pipeline_module_split`, `_build_pipeline_schedule`).

The layers split into stages (`stage_layer_counts`); a rank runs one stage (1F1B, GPipe) or several (Interleaved1F1B
round-robin, ZBVZeroBubble in a V). Each stage is a copy of the meta model with the other stages' layers removed
(and the embedding, final norm and output off the first and last stage), so every parameter keeps its name in the
whole model: a checkpoint saved at one pp loads at any other. Each stage is parallelised on its own (TP, AC,
compile, FSDP2), and `PipelineModel` gathers this rank's stages' modules, under those names, for the optimizer,
clipping and checkpoints; the schedule (`Pipeline`) runs the stages.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from maester.config import Config, ParallelConfig
from maester.models.layers import pack_offsets

if TYPE_CHECKING:
    from maester.parallel.dims import ParallelDims

log = logging.getLogger("maester")

SINGLE_STAGE = ("1F1B", "GPipe")
"""Schedules that run one stage per rank; the others run several."""


def stages_per_rank(p: ParallelConfig) -> int:
    """`len(pp_layers) / pp` where given; else 1 for a single-stage schedule, 2 for the others."""
    if p.pp_layers is not None:
        return max(1, len(p.pp_layers) // p.pp)
    return 1 if p.pp_schedule in SINGLE_STAGE else 2


def stage_layer_counts(n_layers: int, p: ParallelConfig) -> list[int]:
    """Layers per stage, first to last: `parallel.pp_layers`, else an even split (earlier stages one more)."""
    if p.pp_layers is not None:
        return list(p.pp_layers)
    n = p.pp * stages_per_rank(p)
    base, extra = divmod(n_layers, n)
    return [base + (i < extra) for i in range(n)]


def check_pipeline(cfg: Config, n_layers: int, micro_batches: int, on_gpu: bool) -> None:
    """Refuse a pipeline layout that cannot run, naming the key to change. `micro_batches`: a rank's micro-batches
    per step (the batch plan's accumulation steps), which the schedule pipelines; `on_gpu`: the run's device."""
    p = cfg.parallel
    if p.pp == 1:
        if p.pp_layers is not None:
            raise ValueError("parallel.pp_layers splits the layers into pipeline stages, but parallel.pp = 1: "
                             "set parallel.pp or remove parallel.pp_layers")
        return
    if p.pp_layers is not None:
        n = len(p.pp_layers)
        if p.pp_schedule in SINGLE_STAGE:
            ok, wanted = n == p.pp, "pp"
        elif p.pp_schedule == "ZBVZeroBubble":
            ok, wanted = n == 2 * p.pp, "2 x pp"
        else:  # Interleaved1F1B: any number of stages per rank from 2
            ok, wanted = n % p.pp == 0 and n >= 2 * p.pp, "a multiple of pp, at least 2 x pp"
        if not ok:
            raise ValueError(f"parallel.pp_layers has {n} entries; parallel.pp_schedule = {p.pp_schedule!r} with "
                             f"pp = {p.pp} needs one per stage, {wanted} of them")
        if min(p.pp_layers) < 1 or sum(p.pp_layers) != n_layers:
            raise ValueError(f"parallel.pp_layers = {p.pp_layers} must give every stage at least one layer and sum "
                             f"to the model's n_layers = {n_layers}")
    stages = p.pp * stages_per_rank(p)
    if n_layers < stages:
        raise ValueError(f"parallel.pp = {p.pp} with pp_schedule {p.pp_schedule!r} makes {stages} pipeline stages, "
                         f"which need at least as many layers, but the model has n_layers = {n_layers}: lower "
                         f"parallel.pp or use a single-stage schedule (1F1B)")
    if micro_batches < p.pp:
        raise ValueError(f"parallel.pp = {p.pp} needs at least {p.pp} micro-batches per step on each rank to fill the "
                         f"pipeline, but the batch plan gives {micro_batches} (training.global_batch_size / "
                         f"data-parallel ranks / training.micro_batch_size): lower training.micro_batch_size or "
                         f"raise training.global_batch_size")
    rounds = max(1, micro_batches // p.pp)
    if p.pp_schedule == "Interleaved1F1B" and micro_batches % rounds:
        raise ValueError(f"parallel.pp_schedule = 'Interleaved1F1B' runs the micro-batches in rounds of pp = {p.pp}: "
                         f"{micro_batches} micro-batches per step do not split into {rounds} rounds; make them a "
                         f"multiple of {p.pp} (training.global_batch_size / training.micro_batch_size)")
    if p.pp_schedule == "ZBVZeroBubble" and not on_gpu and v_schedule_sends_to_itself():
        raise ValueError(f"parallel.pp_schedule = 'ZBVZeroBubble' on the CPU cannot run with torch "
                         f"{torch.__version__}: its pipelining first sends from a rank to itself between the V's "
                         f"two stages on one rank, which gloo cannot do (torch 2.15 does not); use "
                         f"Interleaved1F1B, or a newer torch")
    args = cfg.model.architecture()
    refused = {
        "a mixture-of-experts model (its auxiliary losses and balancing are not carried between stages)":
            args.moe is not None,
        "tied embeddings (the output layer on the last stage would need the first stage's embedding)":
            args.tie_embeddings,
        "DDP (dp_replicate > 1 with dp_shard = 1): use dp_shard (FSDP) or HSDP":
            p.dp_replicate > 1 and p.dp_shard == 1,
        "loading a Hugging Face directory (checkpoint.init_from = 'hf:...'): start from a DCP checkpoint, which "
        "loads at any pp": cfg.checkpoint.init_from_hf is not None,
    }
    for what, present in refused.items():
        if present:
            raise ValueError(f"parallel.pp = {p.pp} does not support {what}")


def v_schedule_sends_to_itself() -> bool:
    """Whether this torch's multi-stage schedules open their point-to-point links with a send to every neighbour
    stage, the same rank's included (torch 2.10's `_get_init_p2p_neighbors_ops`; gone by 2.15)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return hasattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops")


def stage_indices(pp_rank: int, pp: int, n_stages: int, schedule: str) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` runs: round-robin (rank r: r, r + pp, ...), or for a V-shaped schedule
    (ZBV) the pair (r, n_stages - 1 - r), so rank 0 holds the first and the last stage."""
    per_rank = n_stages // pp
    if schedule == "ZBVZeroBubble":
        return pp_rank, n_stages - 1 - pp_rank
    return tuple(pp_rank + s * pp for s in range(per_rank))


def split_stage(whole: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A copy of the (meta) Transformer `whole` with only `layers` and, on the first stage, the embedding, on the
    last the final norm and output: parameter names stay those of the whole model."""
    stage = copy.deepcopy(whole)
    for name in list(stage.layers.keys()):
        if int(name) not in layers:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


class PipelineModel(nn.Module):
    """This rank's pipeline stages seen as one module with the whole model's parameter names (`tok_embeddings`,
    `layers.<i>`, `norm`, `output`, where this rank has them): what the optimizer, clipping and checkpoints take.
    It shares the stages' modules and is never called; `stages` are the `PipelineStage`s the schedule runs, `parts`
    their modules, `whole_model` the meta model (for the FLOPs per token)."""

    def __init__(self, parts: list[nn.Module], stages: list, whole: nn.Module):
        super().__init__()
        self.args = whole.args
        self.parts, self.stages = list(parts), list(stages)  # lists: not submodules
        self.__dict__["whole_model"] = whole  # nor this
        self.tok_embeddings = self.norm = self.output = None
        self.layers = nn.ModuleDict()
        for part in parts:
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(part, name) is not None:
                    setattr(self, name, getattr(part, name))
            for key, block in part.layers.items():
                self.layers[key] = block

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its schedule (maester.parallel.pipeline.Pipeline)")

    def train(self, mode: bool = True) -> "PipelineModel":
        for part in self.parts:
            part.train(mode)
        return super().train(mode)


def build_pipeline_model(whole: nn.Module, dims: "ParallelDims", cfg: Config,
                         parallelize_stage: Callable[[nn.Module], nn.Module],
                         materialize_stage: Callable[[nn.Module, int], nn.Module],
                         device: torch.device) -> PipelineModel:
    """Split the meta model `whole` into this rank's stages; each is parallelised (`parallelize_stage`), then
    materialised (`materialize_stage(module, stage_index)`), and wrapped in a `PipelineStage` over the "pp" mesh."""
    from torch.distributed.pipelining import PipelineStage

    counts = stage_layer_counts(whole.args.n_layers, cfg.parallel)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    pp_mesh = dims.mesh["pp"]
    mine = stage_indices(pp_mesh.get_local_rank(), dims.pp, len(counts), cfg.parallel.pp_schedule)
    log.info("pipeline parallel: %s schedule, %d stages of %s layers over %d ranks; rank %d runs stage(s) %s",
             cfg.parallel.pp_schedule, len(counts), counts, dims.pp, pp_mesh.get_local_rank(), mine)
    parts, stages = [], []
    for s in mine:
        part = split_stage(whole, range(starts[s], starts[s] + counts[s]), s == 0, s == len(counts) - 1)
        part = materialize_stage(parallelize_stage(part), s)
        parts.append(part)
        stages.append(PipelineStage(part, s, len(counts), device, group=pp_mesh.get_group()))
    return PipelineModel(parts, stages, whole)


class PipelineLoss:
    """The last stage's loss of one micro-batch: summed token losses over the step's label tokens (`n_labels`, over
    the data-parallel ranks), times `scale` for backward (FSDP's averaging, a loss scale). The last stage computes
    the summed token losses itself, from the labels every stage receives, with the chunked loss of one process (no
    whole logits); this divides and scales them. Not a running total: torch may call it once more on the first step
    to infer the backward's shapes."""

    def __init__(self):
        self.n_labels = self.scale = None
        self.poison = False

    def __call__(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_sum / self.n_labels
        if self.poison:
            loss = loss * float("nan")
        return loss * self.scale


class Pipeline:
    """A step's forward and backward through this rank's stages with the `parallel.pp_schedule` schedule; the
    micro-batches are the batch plan's (`micro_batches` per step)."""

    def __init__(self, model: PipelineModel, schedule: str, micro_batches: int, pp_group):
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        cls = get_schedule_class(schedule)
        self.loss = PipelineLoss()
        stages = model.stages[0] if issubclass(cls, PipelineScheduleSingle) else model.stages
        # scale_grads=False: the loss is already normalised by the step's label tokens (torchtitan does the same)
        self.schedule = cls(stages, n_microbatches=micro_batches, loss_fn=self.loss, scale_grads=False)
        self.has_first = any(s.is_first for s in model.stages)
        self.has_last = any(s.is_last for s in model.stages)
        self.pp_group = pp_group
        self.stage_modules = {s.stage_index: s.submod for s in model.stages}
        pp, n = dist.get_world_size(pp_group), model.stages[0].num_stages
        self.stage_rank = {s: r for r in range(pp) for s in stage_indices(r, pp, n, schedule)}  # pp group ranks

    def step(self, micro_batches, n_labels: torch.Tensor, scale, device: torch.device,
             poison: bool = False) -> torch.Tensor:
        """Forward and backward of the step; returns the step's loss (this dp rank's share), on every pp rank.
        The position and document ids go to every stage (each makes its own attention masks), and the labels too:
        the last stage returns its micro-batch's summed token losses, not logits (the others ignore them). The
        host-made document offsets go as one host tensor with a row per micro-batch (`layers.pack_offsets`), so
        varlen attention on every stage takes its micro-batch's without counting documents on the device."""
        self.loss.n_labels, self.loss.scale, self.loss.poison = n_labels, scale, poison

        def joined(name: str) -> torch.Tensor:
            return torch.cat([getattr(b, name) for b in micro_batches])

        kwargs = {"position_ids": joined("position_ids"), "labels": joined("labels")}
        if micro_batches[0].document_ids is not None:
            kwargs["document_ids"] = joined("document_ids")
        if micro_batches[0].document_offsets is not None:
            packed = pack_offsets([b.document_offsets.cpu() for b in micro_batches])
            kwargs["document_offsets"] = packed.pin_memory() if device.type == "cuda" else packed
        args = (joined("input_ids"),) if self.has_first else ()
        target = joined("labels") if self.has_last else None
        losses: list[torch.Tensor] = []  # the micro-batches' scaled losses, on the rank with the last stage
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        total = torch.zeros((), device=device)
        for loss in losses:
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()  # DTensor: loss parallel
        total /= scale
        dist.all_reduce(total, group=self.pp_group)
        return total

    @torch.no_grad()
    def evaluate(self, batch, device: torch.device) -> torch.Tensor:
        """The summed token loss of one batch (validation), on every pp rank: the batch goes through the stages in
        order, not pipelined, each rank running its stages as their input arrives from the rank before, over the
        pp group (the communicators training uses, not new ones on the world)."""
        kwargs = {"position_ids": batch.position_ids, "labels": batch.labels,
                  "document_offsets": batch.document_offsets}
        if batch.document_ids is not None:
            kwargs["document_ids"] = batch.document_ids
        me, last = dist.get_rank(self.pp_group), len(self.stage_rank) - 1
        h, total = batch.input_ids, torch.zeros((), device=device)
        for index in sorted(self.stage_modules):
            if index > 0 and self.stage_rank[index - 1] != me:
                h = receive_tensor(self.stage_rank[index - 1], self.pp_group, device)
            h = self.stage_modules[index](h, **kwargs)
            if index == last:  # the summed token losses
                total += (h.full_tensor() if isinstance(h, DTensor) else h).detach()
            elif self.stage_rank[index + 1] != me:
                send_tensor(h, self.stage_rank[index + 1], self.pp_group)
        dist.all_reduce(total, group=self.pp_group)
        return total


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)


def send_tensor(t: torch.Tensor, dst: int, group) -> None:
    """`t`, of any shape and one of `_DTYPES`, to rank `dst` of `group`: its rank count and dtype, its shape,
    then its data."""
    header = torch.tensor([t.ndim, _DTYPES.index(t.dtype)], device=t.device)
    for part in (header, torch.tensor(t.shape, dtype=torch.int64, device=t.device), t.contiguous()):
        dist.send(part, group=group, group_dst=dst)


def receive_tensor(src: int, group, device: torch.device) -> torch.Tensor:
    """What `send_tensor` sent from rank `src` of `group`."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    ndim, dtype = header.tolist()
    shape = torch.zeros(ndim, dtype=torch.int64, device=device)
    dist.recv(shape, group=group, group_src=src)
    t = torch.empty(shape.tolist(), dtype=_DTYPES[dtype], device=device)
    dist.recv(t, group=group, group_src=src)
    return t
