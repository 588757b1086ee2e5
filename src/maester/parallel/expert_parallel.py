"""The mixture-of-experts layer over several ranks, applied from outside like the rest of `parallelize`:

- expert parallel (`apply_expert_parallel`): each rank of the "ep" mesh holds n_experts / ep of the stacked expert
  weights (a DTensor, Shard(0)); the tokens a rank routed, already sorted by expert, go by an all-to-all with
  variable splits to the rank holding their expert and come back the same way (torchtitan's ExpertParallel and
  AllToAllTokenDispatcher);
- tensor parallel (`moe_tensor_parallel_plan`): every tp rank routes all tokens with a replicated router and holds
  a slice of every expert's hidden units (gate and up projections by rows, down by columns); the experts' partial
  outputs are summed over the tp ranks (torchtitan's MoE TP plan, MOE_SHARDING.md "EP off").
- both: the tp plan first, then each expert weight split by expert over ep and by hidden unit over tp.

The routed experts compute on local tensors in both; the MoE module itself is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from maester.models.moe import MoEFeedForward, moe_layers


class _ExpertDispatch:
    """Hooks of one GroupedExperts under expert parallel: dispatch before its forward, combine after it. The state
    between the two (splits, order) is this layer's current forward's; a checkpointed recompute sets it again."""

    def __init__(self, ep_mesh):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.input_splits: list[int] = []
        self.output_splits: list[int] = []
        self.order: torch.Tensor | None = None

    def dispatch(self, module, args):
        """(tokens sorted by expert, counts per expert of all E) -> (tokens of this rank's experts sorted by local
        expert, counts per local expert on the device and on the host): one count exchange, one host read of the
        splits (as torchtitan's token dispatch), one token all-to-all."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        x, counts = args
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)  # [from rank i][local expert]
        # One host read: the split sizes, and the tokens of each local expert for the experts' loop (where no
        # grouped GEMM runs: `moe.grouped_mm_fast_path`), which then reads nothing more.
        on_host = torch.cat([counts.view(self.ep, -1).sum(1), received.view(self.ep, -1).sum(1),
                             received.view(self.ep, -1).sum(0)]).tolist()
        self.input_splits, self.output_splits = on_host[:self.ep], on_host[self.ep:2 * self.ep]
        x = all_to_all_single_autograd(x, self.output_splits, self.input_splits, self.group)
        # The tokens arrive grouped by source rank, then by local expert: regroup them by local expert.
        per_source = received.view(self.ep, -1)
        local = torch.arange(per_source.numel(), device=counts.device) % per_source.shape[1]
        # output_size: the length known on the host; without it repeat_interleave waits for the device
        self.order = local.repeat_interleave(per_source.reshape(-1), output_size=x.shape[0]).argsort(stable=True)
        return x[self.order], per_source.sum(0), on_host[2 * self.ep:]

    def combine(self, module, args, out):
        """The experts' outputs back in the order they arrived, then back to the ranks that sent the tokens."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        out = out[self.order.argsort()]
        return all_to_all_single_autograd(out, self.input_splits, self.output_splits, self.group)


def apply_expert_parallel(model: nn.Module, mesh) -> None:
    """Split every MoE layer's experts over the "ep" mesh (contiguous blocks of n_experts / ep per rank, the order
    the tokens are sorted in) and route their tokens there and back.

    `mesh`: the 1-D "ep" mesh, or under tensor parallel the 2-D ("ep", "tp") mesh, applied after
    `moe_tensor_parallel_plan` has split the experts' hidden units over tp: each weight becomes a DTensor split by
    expert over ep and by hidden unit over tp (torchtitan's ExpertTensorParallel, torchtitan/distributed/
    expert_parallel.py before pytorch/torchtitan#3167). Every tp rank routes the same tokens, so the all-to-all over
    ep (among the ranks of one tp index) brings each the same tokens as its tp peers; the tp plan's hooks, registered
    first, run first: the partial outputs are summed over tp before the combine, the input gradients after it."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    ep_mesh = mesh["ep"] if mesh.ndim == 2 else mesh
    ep_rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    for moe in moe_layers(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if mesh.ndim == 1:
                sharded = distribute_tensor(param.data, mesh, [Shard(0)])
            else:
                if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names != ("tp",):
                    raise ValueError(f"apply_expert_parallel on an (ep, tp) mesh needs the experts' {name} split "
                                     f"over tp first: apply the tensor parallel plan before expert parallel")
                local = param.to_local()  # every expert, this tp rank's hidden units; keep this ep rank's experts
                n = local.shape[0] // ep
                sharded = DTensor.from_local(local[ep_rank * n:(ep_rank + 1) * n].clone(), mesh,
                                             [Shard(0), *param.placements], run_check=False,
                                             shape=param.shape, stride=param.stride())
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        hooks = _ExpertDispatch(ep_mesh)
        experts.register_forward_pre_hook(hooks.dispatch)
        experts.register_forward_hook(hooks.combine)


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tp ranks (each holds a slice of the experts' hidden
    units, so each has a partial input gradient). Megatron's f."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sums the experts' partial outputs over the tp ranks; backward passes the (replicated) gradient through.
    Megatron's g."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _experts_tensor_parallel():
    """The ParallelStyle of GroupedExperts under TP: hidden units split, inputs and outputs plain tensors."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    dims = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}  # (E, hidden, dim), (E, hidden, dim), (E, dim, hidden)

    def partition(name, module, mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, mesh, [Shard(dims[pname])])
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))

    class ExpertsTensorParallel(ParallelStyle):
        def _apply(self, module, device_mesh):
            group = device_mesh.get_group()
            return distribute_module(
                module, device_mesh, partition,
                input_fn=lambda mod, inputs, mesh: (_CopyToTensorParallel.apply(inputs[0], group), *inputs[1:]),
                output_fn=lambda mod, out, mesh: _ReduceFromTensorParallel.apply(out, group))

    return ExpertsTensorParallel()


def _replicated_router():
    """The router's gate as a replicated DTensor: every tp rank routes every token the same way, and its gradient
    is whole on each rank (no reduction)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def partition(name, module, mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, mesh, [Replicate()])
            module.register_parameter(pname, nn.Parameter(replicated, requires_grad=param.requires_grad))

    class ReplicatedRouter(ParallelStyle):
        def _apply(self, module, device_mesh):
            return distribute_module(
                module, device_mesh, partition,
                input_fn=lambda mod, inputs, mesh: (DTensor.from_local(inputs[0], mesh, [Replicate()],
                                                                       run_check=False),),
                output_fn=lambda mod, out, mesh: out.to_local())

    return ReplicatedRouter()


def moe_tensor_parallel_plan(moe: MoEFeedForward, prefix: str, sequence_parallel: bool) -> dict:
    """The TP plan entries of one block's MoE feed-forward (`prefix` "feed_forward"): its input gathered whole
    (from sequence shards under SP) as a plain tensor, the router replicated, the experts' hidden units split, the
    shared experts Megatron-style, and the output back to the residual stream's layout."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan = {
        prefix: PrepareModuleInputOutput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),),
                                         use_local_input=True, output_layouts=(Replicate(),),
                                         desired_output_layouts=(between_blocks,), use_local_output=True),
        f"{prefix}.router.gate": _replicated_router(),
        f"{prefix}.experts": _experts_tensor_parallel(),
    }
    if moe.shared_experts is not None:
        plan[f"{prefix}.shared_experts.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.shared_experts.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.shared_experts.down_proj"] = RowwiseParallel()
    return plan
