"""Muon's matrices across ranks: where each rank's piece of a matrix lies in the whole, and the two all-to-alls
that bring each matrix whole to one rank and give every rank its piece of the result.

A parameter may be a plain tensor (one process, or DDP: every rank a whole copy) or a DTensor (FSDP2, HSDP,
tensor parallel and their combinations). Its `Layout` is found once, with one all-gather over its ranks.

Scheme (`work_on_whole`): the matrices held by the same set of ranks are dealt round-robin to those ranks (matrix
j of the set to group rank j mod n). One all-to-all sends each owner the pieces of its matrices from the ranks of
one copy of each (the owner's own copy: its FSDP shard group under HSDP, only itself for a replicated matrix);
the owner reassembles them and works on each whole, and a second all-to-all sends every rank its piece of each
result. Each rank thus works on about 1/n of the matrices and sends and receives about its share of them twice.
One process holding its matrices whole does the same locally.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Index = slice | Tensor  # rows or columns of a matrix: a range, or a list of indices (for strided shards)


@dataclass
class Layout:
    """Where the pieces of one matrix live: for each rank of `group` (in group-rank order), the global rows and
    columns of its local piece and which copy of the matrix it belongs to. A layout shards rows and columns
    independently, so every piece is a row set times a column set."""

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


def is_dtensor(t: Tensor) -> bool:
    # Without torch.distributed.tensor imported there are no DTensors, and one process need not import it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's piece of a plain tensor or DTensor (the same storage: in-place changes reach `t`)."""
    return t.to_local() if is_dtensor(t) else t


def layout_name(p: Tensor) -> str:
    if is_dtensor(p):
        return f"DTensor {tuple(p.placements)} over mesh {p.device_mesh}"
    return "plain tensor"


class Layouts:
    """The layout of each parameter, built on first use and kept (it is the model's, not optimizer state)."""

    def __init__(self):
        self._layouts: dict[Tensor, Layout] = {}
        self._groups: dict[Any, dist.ProcessGroup] = {}

    def of(self, p: Tensor) -> Layout:
        if p not in self._layouts:
            self.build([p])
        return self._layouts[p]

    def build(self, params: list[Tensor]) -> None:
        """The layouts of `params` not known yet, with one object all-gather per process group for all of them
        (not one per matrix: over gloo each costs a round trip). Every rank passes the same parameters in the
        same order, so the groups' gathers come in the same order everywhere."""
        pieces: dict[Any, dict[Tensor, Any]] = {}  # group -> {parameter: this rank's piece}, in order
        for p in params:
            if p in self._layouts or any(p in known for known in pieces.values()):
                continue
            group, mine = self._piece(p)
            if group is None:
                rows, cols = p.shape
                self._layouts[p] = Layout(None, 0, [slice(0, rows)], [slice(0, cols)], [()])
            else:
                pieces.setdefault(group, {})[p] = mine
        for group, mine in pieces.items():
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, list(mine.values()), group=group)
            for i, p in enumerate(mine):
                device = local(p).device
                self._layouts[p] = Layout(group, dist.get_rank(group),
                                          [_as_index(e[i][0].to(device)) for e in everyone],
                                          [_as_index(e[i][1].to(device)) for e in everyone],
                                          [e[i][2] for e in everyone])

    def _piece(self, p: Tensor) -> tuple[dist.ProcessGroup | None, Any]:
        """The group of ranks holding `p` (None: this process alone) and this rank's piece: its global rows and
        columns and which copy of the matrix it holds."""
        rows, cols = p.shape
        device = local(p).device
        if not is_dtensor(p):
            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                return None, None
            # Plain tensors across processes: DDP, every rank a whole copy with the same averaged gradient.
            group, mine = dist.group.WORLD, (torch.arange(rows), torch.arange(cols), (dist.get_rank(),))
        else:
            from torch.distributed.tensor import distribute_tensor

            mesh, placements = p.device_mesh, p.placements
            if any(pl.is_partial() for pl in placements):
                raise ValueError(f"Muon: a parameter of shape {(rows, cols)} is laid out as {layout_name(p)}; "
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
                                 f"of shape {(rows, cols)} laid out as {layout_name(p)}")
        if "nccl" in str(dist.get_backend(group)) and device.type != "cuda":
            raise ValueError(f"Muon: a parameter of shape {(rows, cols)} ({layout_name(p)}) is on {device}, but its "
                             f"ranks talk over NCCL; CPU-offloaded parameters are not handled by Muon")
        return group, mine

    def _mesh_group(self, mesh) -> dist.ProcessGroup:
        """The process group of all ranks of `mesh` (flattened, for a mesh of more than one dimension)."""
        if mesh not in self._groups:
            self._groups[mesh] = (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()
        return self._groups[mesh]


@dataclass
class ShardedMatrix:
    """A matrix to be worked on whole: this rank's piece of it and where every rank's piece lies."""

    piece: Tensor
    shape: tuple[int, int]
    layout: Layout
    dtype: torch.dtype  # the pieces travel, and the whole is assembled, in this dtype
    row_values: bool  # the work on the whole also gives one float32 value per row, for every rank


# Work on matrix j, given whole: the result (shaped like the matrix) and, where the matrix has `row_values`, a
# float32 vector of one value per row.
Work = Callable[[int, Tensor], tuple[Tensor, Tensor | None]]


def work_on_whole(matrices: list[ShardedMatrix], work: Work) -> list[tuple[Tensor, Tensor | None]]:
    """`work(j, whole)` on each matrix j, done by one rank of those holding it; for each, this rank's piece of the
    result and, where the matrix has `row_values`, the whole vector of row values."""
    results: list[tuple[Tensor, Tensor | None] | None] = [None] * len(matrices)
    by_group: dict[Any, list[int]] = {}
    for i, m in enumerate(matrices):
        by_group.setdefault(m.layout.group, []).append(i)
    for indices in by_group.values():
        for i, result in zip(indices, _work_in_group(matrices, indices, work)):
            results[i] = result
    return results  # type: ignore[return-value]


def _work_in_group(everything: list[ShardedMatrix], indices: list[int],
                   work: Work) -> list[tuple[Tensor, Tensor | None]]:
    """`work_on_whole` of the matrices `everything[i]` for i in `indices`, all held by the same ranks."""
    matrices = [everything[i] for i in indices]
    layout0 = matrices[0].layout
    n, me = layout0.size, layout0.rank
    device = matrices[0].piece.device
    owner = [j % n for j in range(len(matrices))]
    mine = [j for j in range(len(matrices)) if owner[j] == me]

    # 1. Pieces of each matrix to their owner, from the ranks of the owner's copy of the matrix.
    sends = [[m.piece.to(m.dtype) for j, m in enumerate(matrices)
              if owner[j] == dst and m.layout.copy[dst] == m.layout.copy[me]] for dst in range(n)]
    specs = [[(m.layout.shape(src), m.dtype) for m in (matrices[j] for j in mine)
              if m.layout.copy[src] == m.layout.copy[me]] for src in range(n)]
    received = _all_to_all(sends, specs, layout0.group, device)
    pieces_from = [iter(r) for r in received]

    # 2. Reassemble this rank's matrices and work on them.
    outputs: dict[int, tuple[Tensor, Tensor | None]] = {}
    for j in mine:
        m = matrices[j]
        whole = torch.empty(m.shape, dtype=m.dtype, device=device)
        for src in range(n):
            if m.layout.copy[src] == m.layout.copy[me]:
                whole[m.layout.region(src)] = next(pieces_from[src])
        outputs[j] = work(indices[j], whole)

    # 3. Every rank its piece of each result (and the row values whole).
    sends = []
    for dst in range(n):
        out = []
        for j in mine:
            result, row_values = outputs[j]
            out.append(result[matrices[j].layout.region(dst)])
            if row_values is not None:
                out.append(row_values)
        sends.append(out)
    specs = []
    for src in range(n):
        spec = []
        for j, m in enumerate(matrices):
            if owner[j] == src:
                spec.append((m.layout.shape(me), m.dtype))
                if m.row_values:
                    spec.append(((m.shape[0],), torch.float32))
        specs.append(spec)
    received = [iter(r) for r in _all_to_all(sends, specs, layout0.group, device)]
    results = []
    for j, m in enumerate(matrices):
        piece = next(received[owner[j]])
        results.append((piece, next(received[owner[j]]) if m.row_values else None))
    return results


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
