"""Eight ranks in one process with torch's LocalTensorMode (torch.distributed._local_tensor, torchtitan's
`comm.mode = "local_tensor"`): every tensor holds each simulated rank's value, every collective computes what the
ranks would exchange, over a fake process group. What runs is maester's own: the mesh, `build_training_model`
(HSDP, TP, EP, FSDP-sharded experts, the pipeline stages), the forward with its loss (loss parallel under TP),
`clip_grad_norm` and the optimizer; `train_simulated` compares them step by step with one process
(`train_one_process`).

What LocalTensorMode in torch 2.15 cannot run, and how it is stood in for (each said where it happens):
- FSDP2 frees a gathered parameter by resizing its storage to zero, which a LocalTensor (a wrapper without storage)
  refuses: `fsdp_storage_per_rank` resizes each rank's storage instead (`torch.distributed.fsdp` internals).
- A pipeline is MPMD: torch's schedules send between ranks that run different stages, and LocalTensorMode's
  point-to-point ops need its own runner (`LocalRunnerMode`), which the schedules do not use. So the stages run under
  one LocalTensorMode each (their ranks only), micro-batch by micro-batch in GPipe order, the hidden states and
  their gradients handed from one stage's ranks to the next stage's here (what the schedule's send/recv carry), the
  gradient norm's sum over the stages taken here. The schedule itself (`maester.parallel.pipeline.Pipeline`) is
  covered by tests/distributed/test_pipeline.py on real processes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from maester.config import Config

VOCAB = 256  # the byte tokenizer's


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]
    gradients: dict[str, torch.Tensor]
    """Every parameter's whole gradient at the first step (later steps' parameters differ in the last bits, which
    Adam's division by the root of the second moment can blow up where a gradient element is near zero)."""


@contextlib.contextmanager
def fsdp_storage_per_rank():
    """FSDP2's alloc_storage/free_storage resize the storage of each rank's tensor inside a LocalTensor."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group
    from torch.distributed._local_tensor import LocalTensor

    alloc, free = fsdp_param.alloc_storage, fsdp_param.free_storage

    def per_rank(function):
        def apply(tensor):
            for t in (tensor._local_tensors.values() if isinstance(tensor, LocalTensor) else [tensor]):
                function(t)
        return apply

    fsdp_param.alloc_storage = fsdp_param_group.alloc_storage = per_rank(alloc)
    fsdp_param.free_storage = per_rank(free)
    try:
        yield
    finally:
        fsdp_param.alloc_storage = fsdp_param_group.alloc_storage = alloc
        fsdp_param.free_storage = free


def step_batches(cfg: Config, step: int, dp: int) -> list[list[torch.Tensor]]:
    """Each data-parallel rank's micro-batches of `step` (token rows of seq_len + 1: inputs and next-token labels),
    drawn from a generator of the step: the same numbers for the simulated ranks and for one process."""
    g = torch.Generator().manual_seed(1000 + step)
    seq, micro = cfg.data.seq_len, cfg.training.micro_batch_size
    per_rank = cfg.training.global_batch_size // dp // micro
    rows = torch.randint(0, VOCAB, (dp, per_rank, micro, seq + 1), generator=g)
    return [[rows[d, m] for m in range(per_rank)] for d in range(dp)]


def _loss_context(model):
    from maester.parallel.parallelize import uses_loss_parallel

    if not uses_loss_parallel(model):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def train_one_process(cfg: Config, steps: int, dp: int) -> Run:
    """The reference: the whole model in one process, every rank's micro-batches of a step summed into its loss."""
    from maester.models.build import build_model
    from maester.train.optim import build_optimizer, clip_grad_norm

    model = build_model(cfg.model, VOCAB, torch.device("cpu"), cfg.training.seed, cfg.mup)
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    run = Run([], [], {})
    for step in range(steps):
        batches = [b for rank in step_batches(cfg, step, dp) for b in rank]
        n_labels = sum(b[:, 1:].numel() for b in batches)
        total = 0.0
        for rows in batches:
            loss = model(rows[:, :-1], _positions(rows), labels=rows[:, 1:]) / n_labels
            loss.backward()
            total += loss.item()
        norm, _ = clip_grad_norm(params, math.inf)
        if step == 0:
            run.gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(total)
        run.grad_norms.append(norm.item())
    return run


def _positions(rows: torch.Tensor) -> torch.Tensor:
    # Passed explicitly: RoPE's table cache keys on the frequencies' data pointer, which a LocalTensor has not.
    return torch.arange(rows.shape[1] - 1).expand(rows.shape[0], -1)


def dp_index(dims, rank: int) -> int:
    """The data-parallel rank of global `rank` (its batch), from the mesh's layout."""
    coords = (dims.mesh.mesh == rank).nonzero()[0].tolist()  # (pp, dp_replicate, dp_shard_mod_ep, ep, cp, tp)
    _, rep, shard, ep, _, _ = coords
    return (rep * (dims.dp_shard // dims.ep) + shard) * dims.ep + ep


def _per_rank(ranks, value) -> torch.Tensor:
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor({r: value(r) for r in ranks})


def _value(t, rank: int) -> float:
    """Rank `rank`'s value of a scalar LocalTensor (or DTensor of one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t._local_tensors[rank].item()


def _full_gradients(model, ranks: list[int]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient gathered whole; the same on every simulated rank (checked), rank `ranks[0]`'s."""
    from torch.distributed.tensor import DTensor

    from maester.models.transformer import canonical_parameter_name

    out = {}
    for name, p in model.named_parameters():
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        values = full._local_tensors
        for r in ranks[1:]:
            torch.testing.assert_close(values[r], values[ranks[0]], rtol=0, atol=0)
        out[canonical_parameter_name(name)] = values[ranks[0]].detach().clone()
    return out


def train_simulated(cfg: Config, world: int, steps: int) -> Run:
    """`cfg` on `world` simulated ranks (one LocalTensorMode, or one per pipeline stage), `steps` steps."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from maester.parallel.dims import ParallelDims
    from maester.parallel.precision import resolve_precision
    from maester.train.optim import build_optimizer, clip_grad_norm
    from maester.train.setup import build_training_model

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    # The build's info lines would format the simulated ranks' own ints (`rank %d`), which only LocalTensorMode
    # reads: what a handler may do with them depends on the tests run before in this process.
    logger = logging.getLogger("maester")
    level = logger.level
    logger.setLevel(logging.WARNING)  # setLevel, not the attribute: it also clears the logger's cached checks
    try:
        dims = ParallelDims.from_config(cfg, world)
        precision = resolve_precision("fp32", "auto", "cpu", dims.fsdp_enabled)
        groups = [list(range(s * world // dims.pp, (s + 1) * world // dims.pp)) for s in range(dims.pp)]
        dp_of = {r: dp_index(dims, r) for r in range(world)}
        modes, models, optimizers = [], [], []
        with fsdp_storage_per_rank():
            for ranks in groups:  # a stage's ranks run one program: one mode each
                mode = LocalTensorMode(frozenset(ranks))
                with mode:
                    model = build_training_model(cfg, VOCAB, dims, torch.device("cpu"), precision)
                    optimizers.append(build_optimizer(model, cfg.optimizer, torch.device("cpu")))
                modes.append(mode)
                models.append(model)
            run = Run([], [], {})
            scale = dims.dp_size * dims.cp
            for step in range(steps):
                batches = step_batches(cfg, step, dims.dp_size)
                n_labels = sum(b[:, 1:].numel() for rank in batches for b in rank)
                loss, squares = _simulated_step(models, modes, groups, batches, dp_of, n_labels, scale,
                                                clip_grad_norm, optimizers, run.gradients if step == 0 else None)
                run.losses.append(loss)
                run.grad_norms.append(math.sqrt(squares))
        return run
    finally:
        logger.setLevel(level)
        dist.destroy_process_group()


def _simulated_step(models, modes, groups, batches, dp_of, n_labels, scale, clip_grad_norm, optimizers,
                    gradients: dict | None):
    """One step: each micro-batch forward through the stages (the hidden states handed on by their ranks' dp
    position), its loss on the last stage, backward through the stages in reverse; then each stage's gradient norm
    (its squares summed over the stages, as the pp all-reduce does) and optimizer step; the whole gradients into
    `gradients` where given. Returns (the step's loss summed over the data-parallel ranks, the squared gradient
    norm)."""
    from torch.distributed._local_tensor import LocalTensor

    from maester.models.loss import cross_entropy_sum

    last = len(models) - 1
    micro_batches = len(batches[0])
    step_loss = 0.0
    for m in range(micro_batches):
        inputs, outputs = [], []
        h = None
        for s, (model, mode, ranks) in enumerate(zip(models, modes, groups)):
            stage = getattr(model, "parts", [model])[0]  # a pipeline rank's stage module (one per rank: GPipe, 1F1B)
            with mode:
                rows = _per_rank(ranks, lambda r: batches[dp_of[r]][m])
                position_ids = _positions(rows)
                if s == 0:
                    x = rows[:, :-1]
                else:  # what the previous stage's rank at the same dp position sends
                    offset = ranks[0] - groups[s - 1][0]
                    x = LocalTensor({r: h._local_tensors[r - offset].detach().clone() for r in ranks})
                    x.requires_grad_(True)
                inputs.append(x)
                with _loss_context(stage):
                    if s == last:
                        labels = rows[:, 1:]
                        if s == 0:
                            out = stage(x, position_ids, labels=labels)
                        else:  # the pipeline's loss (`PipelineLoss`) on the last stage's logits
                            out = cross_entropy_sum(stage(x, position_ids), labels)
                        out = out / n_labels
                        (out * scale).backward()
                        seen = set()
                        for r in ranks:  # one rank per data-parallel position holds its loss
                            if dp_of[r] not in seen:
                                seen.add(dp_of[r])
                                step_loss += _value(out, r)
                    else:
                        h = stage(x, position_ids)
                outputs.append(h)
        for s in range(last - 1, -1, -1):  # backward through the earlier stages, the gradients handed back
            with modes[s]:
                offset = groups[s + 1][0] - groups[s][0]
                grad = inputs[s + 1].grad
                outputs[s].backward(LocalTensor({r: grad._local_tensors[r + offset] for r in groups[s]}))
    squares = 0.0
    for model, mode, ranks, optimizer in zip(models, modes, groups, optimizers):
        with mode:
            params = [p for p in model.parameters() if p.requires_grad]
            norm, _ = clip_grad_norm(params, math.inf)
            squares += _value(norm, ranks[0]) ** 2
            if gradients is not None:
                gradients.update(_full_gradients(model, ranks))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step_loss, squares
