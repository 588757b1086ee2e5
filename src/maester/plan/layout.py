"""`maester plan --ranks all`: every rank of a layout built in turn, in a fake process group, on the meta device:
its mesh, its pipeline stages, its experts, its shards. Then what a checkpoint of the layout would hold is compared
with one process's model: the chunks DCP writes for each tensor (`torch.distributed.checkpoint`'s own planner) must,
over all ranks, cover every element of every tensor, under the names and shapes one process has, so that the
checkpoint resumes at any other layout (DCP reshards by name, shape and offsets)."""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

import torch

from maester.config import Config
from maester.plan.memory import fake_world, plan_config, vocab_size


PROGRESS_SECONDS = 30
"""Where stderr is not a terminal: a line of progress this often (about 0.85 s a rank: 512 ranks take 7 minutes)."""


@dataclass
class LayoutCheck:
    world_size: int
    tensors: int = 0
    ranks: dict[int, str] = field(default_factory=dict)
    """What each rank holds, in words: its pipeline stages and layers, its experts."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        groups: dict[str, list[int]] = {}
        for rank, what in self.ranks.items():
            groups.setdefault(what, []).append(rank)
        lines = [f"every rank of {self.world_size}: " + ("builds" if self.ok else "PROBLEMS")]
        for what, ranks in groups.items():
            lines.append(f"  ranks {_spans(ranks)}: {what}")
        if self.ok:
            lines.append(f"  checkpoint: {self.tensors} tensors, each covered whole by the ranks' shards under one "
                         f"process's names and shapes: it resumes at any layout")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "ok": self.ok, "tensors": self.tensors,
                "ranks": {str(r): w for r, w in self.ranks.items()}, "problems": self.problems}


def _spans(ranks: list[int]) -> str:
    out = []
    for _, group in itertools.groupby(enumerate(sorted(ranks)), lambda p: p[1] - p[0]):
        values = [v for _, v in group]
        out.append(str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}")
    return ", ".join(out)


def _chunks(fqn: str, tensor: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the pieces of `tensor` this rank's checkpoint writes, as DCP's planner makes them."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    out = []
    for item in _create_write_items(fqn, tensor):
        chunk = item.tensor_data.chunk
        out.append((tuple(chunk.offsets), tuple(chunk.sizes)))
    return out


def _covers(shape: tuple[int, ...], chunks: set) -> str | None:
    """None when the chunks tile the tensor (replicas may repeat a chunk); else what is wrong."""
    total = 1
    for n in shape:
        total *= n
    volume = 0
    for offsets, sizes in chunks:
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return f"a chunk at {offsets} of {sizes} reaches past the shape {shape}"
        v = 1
        for s in sizes:
            v *= s
        volume += v
    for (oa, sa), (ob, sb) in itertools.combinations(chunks, 2):
        if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)):
            return f"chunks at {oa} and {ob} overlap"
    if volume != total:
        return f"the chunks hold {volume:,} of its {total:,} elements"
    return None


def _describe_rank(model: torch.nn.Module, dims) -> str:
    from maester.models.moe import moe_layers

    parts = []
    stages = getattr(model, "stages", None)
    if stages:
        layers = sorted(int(k) for k in model.layers.keys())
        parts.append(f"pipeline stage(s) {', '.join(str(s.stage_index) for s in stages)}, layers "
                     f"{layers[0]}-{layers[-1]}")
    moe = moe_layers(model)
    if moe and dims.ep > 1:
        n = moe[0].moe.n_experts // dims.ep
        first = dims.mesh["ep"].get_local_rank() * n
        parts.append(f"experts {first}-{first + n - 1} of {moe[0].moe.n_experts} in each MoE layer")
    return "; ".join(parts) or "every layer, sharded"


def check_every_rank(cfg: Config, world_size: int, device_type: str = "cuda") -> LayoutCheck:
    """Build every rank of `cfg` on `world_size` ranks and check its checkpoint resumes at any layout."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from maester.models.build import build_on_meta, resolve_args
    from maester.parallel.dims import ParallelDims
    from maester.parallel.precision import resolve_precision
    from maester.progress import progress_bar
    from maester.train.setup import build_training_model

    cfg = plan_config(cfg, device_type)
    vocab = vocab_size(cfg)
    check = LayoutCheck(world_size)
    reference = build_on_meta(cfg.model, resolve_args(cfg.model, vocab, cfg.mup))
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    found: dict[str, set] = {}
    shapes: dict[str, tuple] = {}
    meta = torch.device("meta")
    for rank in progress_bar("building every rank", total=world_size, iterable=range(world_size), unit=" ranks",
                             lines_every=PROGRESS_SECONDS):
        with fake_world(world_size, rank), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dims = ParallelDims.from_config(cfg, world_size)
                precision = resolve_precision(cfg.training.precision, cfg.parallel.param_dtype, device_type,
                                              dims.fsdp_enabled)
                model = build_training_model(cfg, vocab, dims, meta, precision, initialise=False)
                state = get_model_state_dict(model)
            except (ValueError, RuntimeError, NotImplementedError) as e:
                check.problems.append(f"rank {rank} does not build: {e}")
                continue
            check.ranks[rank] = _describe_rank(model, dims)
            for name, tensor in state.items():
                if name not in expected:
                    check.problems.append(f"rank {rank} holds {name}, which one process's model has not")
                    continue
                shapes[name] = tuple(tensor.shape)
                found.setdefault(name, set()).update(_chunks(name, tensor))
    for name, shape in expected.items():
        if name not in found:
            check.problems.append(f"no rank holds {name}: a checkpoint of this layout would lack it")
            continue
        if shapes[name] != shape:
            check.problems.append(f"{name} has the shape {shapes[name]} here, {shape} in one process")
        problem = _covers(shape, found[name])
        if problem is not None:
            check.problems.append(f"{name}: {problem}")
    check.tensors = len(found)
    return check
