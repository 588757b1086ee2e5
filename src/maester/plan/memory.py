"""Per-rank memory of a training step, predicted on one CPU without a GPU.

One rank of an N-rank layout goes through the run's own build path (the mesh, `build_training_model`: CP, TP, EP,
AC, FSDP2; the optimizer; the loss) in a fake process group (`init_process_group("fake")`: no
other process, every collective returns at once) on fake tensors (shapes and dtypes, no storage), and one step of
it, forward, backward, clipping and the optimizer, is counted by torch's memory trackers
(`torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`, or `mem_tracker.MemTracker` without FSDP), as
torchtitan's former `scripts/estimate/estimation.py` counted FSDP2 runs. `track_step` counts a real step the same way
(the calibration tests and the GPU check compare the two).

Where the prediction departs from a GPU run, and why:
- Blocks run eagerly: compiled blocks may keep less (Inductor recomputes cheap ops), so with `parallel.compile` the
  activations are an upper bound.
- Attention keeps what the GPU kernels keep (`layers.memory_of_gpu_kernels`): documents, windows and soft-caps
  change which kernel runs, not what it keeps.
- Mixture of experts: routing is taken as balanced (`moe.balanced_routing`); a collapsed router sends more tokens to
  one rank's experts.
- Depth: a model deeper than `EXACT_DEPTH` blocks is tracked at two depths of whole units (one activation
  checkpointing period) and each category extrapolated linearly to the model's depth; every block adds the same.
- `parallel.cpu_offload`: the sharded parameters, their gradients and the optimizer state move to host memory
  (FSDP2's CPUOffloadPolicy); the step is tracked without the offload and those three are then counted on the host.
- A training step holds one micro-batch's activations, the gradients accumulated over the earlier micro-batches,
  and the optimizer state from the step before.
- Pipeline parallel is not planned yet (`predict_rank_memory` says why); `maester plan --ranks all` builds its
  stages.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from maester.config import Config
from maester.data.batch import Batch

GiB = 2**30
EXACT_DEPTH = 4
"""Models of at most this many blocks (per activation checkpointing period) are tracked whole."""

# The trackers' categories (FSDPMemTracker's, then MemTracker's) as the rows of the plan.
ROWS = {
    "parameters": ("Sharded Param", "Buffer", "Parameter"),
    "gathered parameters": ("Unsharded Param", "All Gather"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Gradient"),
    "optimizer state": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs", "Other"),
    "temporaries": ("Temp",),
}


class PlanUnsupported(ValueError):
    """This torch, or this layout, cannot be planned; the message says why."""


@dataclass(frozen=True)
class StepMemory:
    """Bytes one rank holds at the peak of a step, by row of `ROWS`; `loss`: the loss's own temporaries at their
    peak (chunked logits, their gradients, the output layer's gradient), part of `activations` or `temporaries`
    when the step peaks in the loss; `phase`: where the step peaks ("forward/backward" or "optimizer step");
    `host`: bytes kept in host memory instead (`parallel.cpu_offload`); `state`: the sharded model and optimizer
    state as stored, wherever it lives (what a checkpoint copies)."""

    parameters: float
    gathered_parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    temporaries: float
    loss: float
    phase: str
    host: float = 0.0
    state: float = 0.0

    @property
    def peak(self) -> float:
        return (self.parameters + self.gathered_parameters + self.gradients + self.optimizer_state
                + self.activations + self.temporaries)

    def rows(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gathered parameters": self.gathered_parameters,
                "gradients": self.gradients, "optimizer state": self.optimizer_state,
                "activations": self.activations, "temporaries": self.temporaries}

    def to_json(self) -> dict:
        return {**{k: v / GiB for k, v in asdict(self).items() if k != "phase"}, "phase": self.phase,
                "peak": self.peak / GiB}


def trackers_skip_sharding_propagation() -> bool:
    """Whether this torch's memory trackers leave out the tensors DTensor's sharding propagation makes under a fake
    mode of its own (pytorch/pytorch#183970): without that, a step on fake DTensors is counted wrongly."""
    from torch.distributed._tools.mem_tracker import MemTracker

    probe = MemTracker()
    with probe:
        pass
    return hasattr(probe, "_fake_mode_on_entry")


def require_trackers() -> None:
    if not trackers_skip_sharding_propagation():
        raise PlanUnsupported(f"torch {torch.__version__}'s memory trackers miscount a step on fake DTensors (they "
                              f"count DTensor's sharding propagation, pytorch/pytorch#183970, and FSDP's gathered "
                              f"parameters), so its prediction would be wrong: plan with torch 2.15 or later (`uv "
                              f"sync` installs it); training with this torch is not affected")


def _tracker_classes():
    """FSDPMemTracker and MemTracker, each also keeping the peak of a region it is told about (the loss)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class RegionPeak:
        region_base: int | None = None
        region_peak: int = 0

        def current_total(self) -> int:
            return sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values())

        def begin_region(self) -> None:
            self.region_base = self.current_total()

        def end_region(self) -> None:
            self.region_base = None

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            if self.region_base is not None:
                self.region_peak = max(self.region_peak, self.current_total() - self.region_base)

    class FSDPTracker(RegionPeak, FSDPMemTracker):
        pass

    class Tracker(RegionPeak, MemTracker):
        pass

    return FSDPTracker, Tracker


def _tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    from torch.distributed.fsdp import FSDPModule

    fsdp_tracker, plain_tracker = _tracker_classes()
    if isinstance(model, FSDPModule):
        return fsdp_tracker(model, optimizer)
    tracker = plain_tracker()
    tracker.track_external(model, optimizer)
    return tracker


def _rows_of(snapshot: dict) -> dict[str, int]:
    totals: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for key, value in device_snapshot.items():
            name = getattr(key, "value", key)
            totals[name] = totals.get(name, 0) + value
    return {row: sum(totals.get(k, 0) for k in keys) for row, keys in ROWS.items()}


def _mark_loss(model: torch.nn.Module, tracker):
    """Hooks that tell `tracker` where the loss runs: from the final norm's output to the end of the forward, and in
    backward from the loss to the gradient of that output. Returns the handles and a function for the loss tensor."""
    def after_norm(module, args, out):
        tracker.begin_region()
        if out.requires_grad:
            out.register_hook(lambda grad: tracker.end_region())

    handles = [model.norm.register_forward_hook(after_norm),
               model.register_forward_hook(lambda module, args, out: tracker.end_region())]

    def on_loss(loss: torch.Tensor) -> torch.Tensor:
        if loss.requires_grad:
            loss.register_hook(lambda grad: (tracker.begin_region(), grad)[1])
        return loss

    return handles, on_loss


def _scaled_loss(loss, n_labels, scale):
    return loss / n_labels * scale


def track_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batch: Batch, *, n_micro: int,
               dp_scale: float, precision, device: torch.device, max_grad_norm: float | None) -> StepMemory:
    """Count one training step of `model` with torch's trackers: the optimizer state exists already (the step before
    made it), and with `n_micro` > 1 accumulation steps the gradients too (the earlier micro-batches made them);
    then `micro_batch` goes forward and backward, the gradients are clipped and the optimizer steps. Works on real
    tensors as on fake ones."""
    from maester.parallel.context_parallel import context_parallel_of
    from maester.parallel.parallelize import uses_loss_parallel
    from maester.parallel.precision import autocast
    from maester.train.optim import clip_grad_norm

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # the state of the step before: Adam's moments exist, then the gradients of this step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=n_micro == 1)

    loss_context = contextlib.nullcontext()
    if uses_loss_parallel(model):
        from torch.distributed.tensor.parallel import loss_parallel

        loss_context = loss_parallel()
    n_labels = torch.full((), float(micro_batch.labels.numel() * n_micro), device=device)
    tracker = _tracker(model, optimizer)
    handles, on_loss = _mark_loss(model, tracker)
    try:
        with tracker:
            with loss_context, autocast(precision, device):
                batch = micro_batch
                cp = context_parallel_of(model)
                if cp is not None:
                    batch = cp.shard(batch)
                loss = model(batch.input_ids, batch.position_ids, batch.document_ids, labels=batch.labels)
                on_loss(_scaled_loss(loss, n_labels, dp_scale)).backward()
            step_peak = tracker.get_tracker_snapshot("peak")
            loss_peak = tracker.region_peak
    finally:
        for h in handles:
            h.remove()
    optimizer_tracker = _tracker(model, optimizer)
    with optimizer_tracker:
        clip_grad_norm(params, max_grad_norm or math.inf)
        optimizer.step()
        optimizer_peak = optimizer_tracker.get_tracker_snapshot("peak")
    optimizer.zero_grad(set_to_none=True)
    step_rows, opt_rows = _rows_of(step_peak), _rows_of(optimizer_peak)
    rows, phase = (step_rows, "forward/backward")
    if sum(opt_rows.values()) > sum(step_rows.values()):
        rows, phase = opt_rows, "optimizer step"
    return StepMemory(*(float(rows[r]) for r in ROWS), loss=float(loss_peak), phase=phase)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A fake default process group of `world_size` ranks in which this process is `rank`. DTensor's sharding
    propagation caches its results by mesh layout, not by rank: they are dropped first, or this rank's tensors would
    take the meshes (and shard offsets) of the rank planned before."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is up already: a plan needs the fake one of its own")
    _clear_sharding_caches()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _clear_sharding_caches() -> None:
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:  # the C++ fast path's cache (torch 2.15)
        clear_fast_path()


def vocab_size(cfg: Config) -> int:
    """The model's vocabulary: the flavor's, else the tokenizer's (read from its files)."""
    args = cfg.model.architecture()
    if args.vocab_size is not None:
        return args.vocab_size
    from maester.data.tokenizers import build_tokenizer

    try:
        return build_tokenizer(cfg.tokenizer).vocab_size
    except (OSError, ValueError) as e:
        raise ValueError(f"the plan needs the vocabulary size, which {cfg.model.name}/{cfg.model.flavor} takes from "
                         f"the tokenizer ({e}): set model.overrides.vocab_size") from None


def plan_config(cfg: Config, device_type: str) -> Config:
    """`cfg` as the plan builds it: for `device_type`, blocks eager, no CPU offload (counted afterwards)."""
    parallel = cfg.parallel.model_copy(update={"compile": False, "cpu_offload": False})
    training = cfg.training.model_copy(update={"device": device_type})
    return cfg.model_copy(update={"parallel": parallel, "training": training})


def with_depth(cfg: Config, depth: int) -> Config:
    """`cfg` with `depth` blocks."""
    model = type(cfg.model).model_validate({**cfg.model.model_dump(), "overrides": {**cfg.model.overrides,
                                                                                    "n_layers": depth}})
    return cfg.model_copy(update={"model": model})


def _synthetic_batch(cfg: Config, micro: int, device: torch.device) -> Batch:
    """A micro-batch of `micro` rows of `data.seq_len` tokens, every position labelled (token ids do not change
    memory): plain causal attention, no documents."""
    seq = cfg.data.seq_len
    ids = torch.zeros((micro, seq), dtype=torch.long, device=device)
    return Batch(ids, torch.zeros_like(ids), torch.arange(seq, device=device).expand(micro, seq))


def _step(cfg: Config, dims, model, precision, device: torch.device) -> StepMemory:
    from maester.train.optim import build_optimizer

    optimizer = build_optimizer(model, cfg.optimizer, device)
    plan = dims.batch_plan(cfg)
    scale = dims.dp_size * dims.cp if (dims.fsdp_enabled or dims.ddp_enabled) else 1
    return track_step(model, optimizer, _synthetic_batch(cfg, plan.micro_batch, device),
                      n_micro=plan.accumulation_steps, dp_scale=scale, precision=precision, device=device,
                      max_grad_norm=cfg.training.max_grad_norm)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """`logger_name`'s warnings held back (DTensor's advice on collectives: about speed, not memory)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake_step(cfg: Config, world_size: int, rank: int, vocab: int, device_type: str) -> StepMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from maester.models.build import materialize_for_loading
    from maester.models.layers import memory_of_gpu_kernels
    from maester.models.moe import balanced_routing
    from maester.parallel.dims import ParallelDims
    from maester.parallel.precision import resolve_precision
    from maester.train.setup import build_training_model

    device = torch.device("cpu")  # fake tensors: only their shapes and dtypes count
    with fake_world(world_size, rank), warnings.catch_warnings(), _quiet("torch.distributed.tensor._redistribute"):
        warnings.simplefilter("ignore")  # DTensor's and the mesh's advice is about speed, not about memory
        dims = ParallelDims.from_config(cfg, world_size)
        precision = resolve_precision(cfg.training.precision, cfg.parallel.param_dtype, device_type,
                                      dims.fsdp_enabled)
        # Built and parallelised on the meta device outside the fake mode: FSDP makes meshes on the way (experts over
        # (dp_shard_mod_ep, tp)), which compute on real tensors. Then allocated as fake tensors.
        model = build_training_model(cfg, vocab, dims, torch.device("meta"), precision, initialise=False)
        with FakeTensorMode(allow_non_fake_inputs=True), memory_of_gpu_kernels(), balanced_routing():
            materialize_for_loading(model, device)
            return _step(cfg, dims, model, precision, device)


def measure_rank_memory(cfg: Config, device: torch.device, vocab: int | None = None) -> StepMemory:
    """The same step on real tensors, counted by the same trackers: this process is one rank of the run (its
    process group up where the run has several). What the predictions are checked against."""
    from maester.parallel.dims import ParallelDims
    from maester.parallel.precision import resolve_precision
    from maester.train.setup import build_training_model

    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg, world)
    precision = resolve_precision(cfg.training.precision, cfg.parallel.param_dtype, device.type, dims.fsdp_enabled)
    model = build_training_model(cfg, vocab if vocab is not None else vocab_size(cfg), dims, device, precision)
    return _step(cfg, dims, model, precision, device)


def _extrapolate(a: StepMemory, da: int, b: StepMemory, db: int, depth: int) -> StepMemory:
    """Each row along the line through its values at depths da and db (the loss's temporaries do not grow with
    depth: the deeper run's)."""
    def at(x: float, y: float) -> float:
        return max(0.0, x + (y - x) * (depth - da) / (db - da))

    return replace(b, **{f: at(getattr(a, f), getattr(b, f)) for f in
                         ("parameters", "gathered_parameters", "gradients", "optimizer_state", "activations",
                          "temporaries")})


def predict_rank_memory(cfg: Config, world_size: int, rank: int = 0, device_type: str = "cuda",
                        vocab: int | None = None) -> StepMemory:
    """The step's memory on global rank `rank` of `world_size` ranks training `cfg` on `device_type` devices."""
    require_trackers()
    from maester.parallel.dims import ParallelDims

    if cfg.parallel.pp > 1:
        raise PlanUnsupported(f"parallel.pp = {cfg.parallel.pp}: the memory of pipeline stages is not predicted yet "
                              f"(over a fake process group torch's schedules need every stage's shapes given up "
                              f"front, and its memory trackers count one forward per module and step, a pipeline "
                              f"one per micro-batch); `maester plan --ranks all` checks the layout")
    offload = cfg.parallel.cpu_offload
    cfg = plan_config(cfg, device_type)
    with fake_world(world_size, rank):  # the layout, checked whole before any smaller copy of it is built
        ParallelDims.from_config(cfg, world_size)
    vocab = vocab if vocab is not None else vocab_size(cfg)
    depth = cfg.model.architecture().n_layers
    unit = cfg.parallel.activation_checkpointing_every
    if depth <= EXACT_DEPTH * unit:
        step = _fake_step(cfg, world_size, rank, vocab, device_type)
    else:
        small, large = 2 * unit, 3 * unit
        a = _fake_step(with_depth(cfg, small), world_size, rank, vocab, device_type)
        b = _fake_step(with_depth(cfg, large), world_size, rank, vocab, device_type)
        step = _extrapolate(a, small, b, large, depth)
    step = replace(step, state=step.parameters + step.optimizer_state)
    if offload:
        host = step.parameters + step.gradients + step.optimizer_state
        step = replace(step, parameters=0.0, gradients=0.0, optimizer_state=0.0, host=host)
    return step
