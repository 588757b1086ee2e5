"""Context parallel (`parallel.cp`): every sequence split over the "cp" ranks, attention over the whole sequence
by all-gathering keys and values in each layer (the Llama 3 paper's all-gather CP).

Load balance for the causal mask: a sequence is cut into 2 x cp equal chunks and cp rank r holds chunks r and
2cp-1-r (torch's `_HeadTailLoadBalancer`, torchtitan's default "headtail"), so each rank has as many early
(cheap) as late (costly) queries. The cp ranks of one dp rank read the same batch; `ContextParallel.shard` keeps
this rank's chunks of input_ids, labels, position_ids and document_ids, and RoPE takes the tokens' own positions.
In each layer the keys and values are all-gathered over cp (their gradients reduce-scattered in backward, as
torch's `flex_cp_allgather` in torch/distributed/tensor/experimental/_context_parallel/_cp_custom_ops.py does),
and the local queries attend to all of them with a mask from the tokens' indices in the sequence (causal, sliding
window) and their documents: the attention of one process. Memory: the gathered keys and values of a layer
(2 x seq x kv_heads x head_dim) and, under `sdpa`, a dense boolean mask of batch x seq / cp x seq; FlexAttention
(CUDA) needs only a block mask.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from maester.data.batch import Batch
from maester.models.layers import ContextSplit


@torch.library.custom_op("maester::cp_all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """The cp ranks' `x` concatenated along `dim`, in rank order; backward: the gradient summed over the ranks
    and scattered back (reduce-scatter). A custom op, so that compiled blocks keep it whole."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), group_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out).movedim(0, dim).contiguous()


@all_gather.register_fake
def _(x, dim, group_size, group_name):
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


@torch.library.custom_op("maester::cp_reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", group_size,
                                                           group_name)
    return torch.ops._c10d_functional.wait_tensor(out).movedim(0, dim).contiguous()


@reduce_scatter.register_fake
def _(x, dim, group_size, group_name):
    shape = list(x.shape)
    shape[dim] //= group_size
    return x.new_empty(shape)


def _all_gather_backward(ctx, grad):
    return reduce_scatter(grad, ctx.dim, ctx.group_size, ctx.group_name), None, None, None


def _all_gather_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group_size, ctx.group_name = inputs


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


def gather_keys_and_values(k: torch.Tensor, v: torch.Tensor, group_size: int,
                           group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, kv_heads, local seq, head_dim) keys and values -> those of every cp rank, in one collective."""
    return all_gather(torch.stack((k, v)), 3, group_size, group_name).unbind(0)


class ContextParallel:
    """This rank's part of every sequence (`token_indices`, `shard`) and the attention across the cp group
    (`split`, for `layers.attention_mask`): `size` ranks, this one `rank`, their process group `group_name`."""

    def __init__(self, size: int, rank: int, group_name: str):
        self.size, self.rank, self.group_name = size, rank, group_name
        self._indices: dict = {}

    def token_indices(self, seq: int, device: torch.device, rank: int | None = None) -> torch.Tensor:
        """The indices in a `seq`-token sequence of the tokens `rank` (None: this one) holds: chunks r and
        2cp-1-r of 2 x cp."""
        rank = self.rank if rank is None else rank
        key = (seq, device, rank)
        if key not in self._indices:
            chunk = seq // (2 * self.size)
            first, second = rank * chunk, (2 * self.size - 1 - rank) * chunk
            self._indices[key] = torch.cat((torch.arange(first, first + chunk, device=device),
                                            torch.arange(second, second + chunk, device=device)))
        return self._indices[key]

    def shard(self, batch: Batch) -> Batch:
        """This rank's tokens of a whole batch (every (batch, seq) tensor); `document_lengths` stay whole."""
        seq = batch.input_ids.shape[1]
        if seq % (2 * self.size):
            raise ValueError(f"parallel.cp = {self.size} needs sequences of a multiple of {2 * self.size} tokens, "
                             f"this batch has {seq}: make data.seq_len a multiple of {2 * self.size}")
        idx = self.token_indices(seq, batch.input_ids.device)

        def take(t):
            return None if t is None else t.index_select(1, idx)

        return Batch(take(batch.input_ids), take(batch.labels), take(batch.position_ids), take(batch.document_ids),
                     batch.document_lengths)

    def split(self, document_ids: torch.Tensor | None, seq: int, device: torch.device) -> ContextSplit:
        """What a forward's attention masks need on this rank: `seq` local tokens, their `document_ids` (or None);
        the keys' documents are all-gathered here (one small collective per forward)."""
        whole = seq * self.size
        keys = torch.cat([self.token_indices(whole, device, r) for r in range(self.size)])
        key_documents = None if document_ids is None else \
            all_gather(document_ids.contiguous(), 1, self.size, self.group_name)
        return ContextSplit(self.token_indices(whole, device), keys, key_documents,
                            partial(gather_keys_and_values, group_size=self.size, group_name=self.group_name))


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Make the model's attention span the cp group: its forward then takes this rank's tokens
    (`ContextParallel.shard`) and builds its masks with `ContextParallel.split`."""
    model.context_parallel = ContextParallel(cp_mesh.size(), cp_mesh.get_local_rank(),
                                             cp_mesh.get_group().group_name)


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    return getattr(model, "context_parallel", None)
