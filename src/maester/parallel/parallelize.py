"""Apply a parallel layout to a single-device model, in one fixed order: context parallel ->
tensor/sequence parallel -> expert parallel -> activation checkpointing -> per-block compile -> FSDP2 per block,
then root (or DDP).

Everything here is plain torch.distributed: DTensor `parallelize_module`, `checkpoint_wrapper`, `fully_shard`,
`replicate`. The model must be on the meta device or already materialised; nothing here initialises weights.
"""

from __future__ import annotations

from functools import cache, partial

import torch
from torch import nn

from maester.config import ParallelConfig
from maester.models.moe import MoEFeedForward, moe_layers
from maester.parallel.context_parallel import apply_context_parallel
from maester.parallel.dims import ParallelDims
from maester.parallel.expert_parallel import apply_expert_parallel, moe_tensor_parallel_plan
from maester.parallel.float8 import tensor_parallel_style
from maester.parallel.precision import DTYPES, Precision, resolve_precision


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, device: torch.device,
                precision: Precision | None = None) -> nn.Module:
    """`precision`: the run's (`maester.parallel.precision`); None: `training.precision = "auto"`."""
    if dims.cp > 1:
        apply_context_parallel(model, dims.mesh["cp"])
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh["tp"], float8_comms=device.type == "cuda")
    if dims.ep > 1:
        apply_expert_parallel(model, dims.mesh["ep", "tp"] if dims.tp > 1 else dims.mesh["ep"])
    if cfg.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_every)
    if cfg.compile:
        apply_compile(model)
    if dims.fsdp_enabled:
        def sharded_over(shard: str):  # HSDP: replicated over dp_replicate too
            return dims.submesh("dp_replicate", shard) if dims.dp_replicate > 1 else dims.submesh(shard)

        # The cp ranks of a dp rank hold the same weights. Experts split over ep are FSDP-sharded over the rest of
        # the dp ranks, dividing their gradients by the whole dp size as the dense ones are (torchtitan's apply_fsdp
        # for MoE).
        experts = sharded_over("dp_shard_mod_ep") if dims.ep > 1 else None
        apply_fsdp(model, sharded_over("dp_shard_cp" if dims.cp > 1 else "dp_shard"), cfg, device, precision,
                   experts_mesh=experts, experts_divide=dims.dp_size, pipelined=dims.pp > 1)
    elif dims.ddp_enabled:
        from torch.distributed._composable import replicate

        replicate(model, device_mesh=dims.mesh["dp_replicate"])
    return model


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True,
                          float8_comms: bool = False) -> None:
    """Megatron-style TP over the heads and the MLP's hidden width, with a vocabulary-sharded embedding and head.
    With `sequence_parallel` (training), the activations between blocks are split along the sequence and the
    logits stay vocabulary-sharded for loss parallel. Without it (generation, where a decoding step has one token
    to split), the same plan keeps the activations whole on every rank (the block outputs are all-reduced) and the
    logits come out gathered (untied head) or as a vocabulary-sharded DTensor (tied head): torchtitan's generation
    script applies the same "TP minus SP". `float8_comms`: the float8 layers of the blocks (tensorwise) take torchao's
    float8 TP styles (`float8.tensor_parallel_style`; GPUs only)."""
    from torch.distributed.tensor.parallel import parallelize_module

    # A pipeline stage lacks the modules of the other stages (None): they have no plan.
    plan = {name: style for name, style in _root_plan(model, sequence_parallel).items()
            if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)
    if model.output is None and model.norm is not None:
        # Tied head: F.linear(h, tok_embeddings.weight) with the vocabulary-sharded (Shard(0)) embedding. A replicated
        # final hidden state (gathered from its sequence shards under SP) makes that a column-parallel matmul:
        # vocabulary-sharded logits (Shard(-1)) for loss_parallel, as ColwiseParallel gives an untied head.
        model.norm.register_forward_hook(_replicate_output if sequence_parallel else partial(_as_replicated, tp_mesh))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel, float8_comms))


def _replicate_output(module, args, out):
    from torch.distributed.tensor import Replicate

    return out.redistribute(out.device_mesh, [Replicate()])


def _as_replicated(mesh, module, args, out):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)


def _root_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate())}
        if model.output is not None:
            plan["output"] = ColwiseParallel(output_layouts=Replicate())
        return plan
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    }
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return plan


def _block_plan(block: nn.Module, sequence_parallel: bool, float8_comms: bool = False) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def style(cls: type, *names: str) -> type:  # torch's style, or torchao's float8 one for float8 layers
        return tensor_parallel_style(cls, [block.get_submodule(n) for n in names], float8_comms)

    colwise = lambda name, **kw: style(ColwiseParallel, name)(**kw)  # noqa: E731
    rowwise = lambda name, **kw: style(RowwiseParallel, name)(**kw)  # noqa: E731
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    readers = ["attention.q_proj", "attention.k_proj", "attention.v_proj"]
    plan = {}
    # Under SP each branch gathers its sequence-sharded input first (in float8 where every reader is float8).
    if sequence_parallel:
        plan["attention"] = style(PrepareModuleInput, *readers)(
            input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None))
    plan.update({name: colwise(name) for name in readers})
    plan["attention.o_proj"] = rowwise("attention.o_proj", output_layouts=between_blocks)
    if isinstance(block.feed_forward, MoEFeedForward):
        plan.update(moe_tensor_parallel_plan(block.feed_forward, "feed_forward", sequence_parallel))
    else:
        readers = ["feed_forward.up_proj"] + (["feed_forward.gate_proj"] if hasattr(block.feed_forward, "gate_proj")
                                              else [])
        if sequence_parallel:
            plan["feed_forward"] = style(PrepareModuleInput, *readers)(input_layouts=(Shard(1),),
                                                                       desired_input_layouts=(Replicate(),))
        plan.update({name: colwise(name) for name in readers})
        plan["feed_forward.down_proj"] = rowwise("feed_forward.down_proj", output_layouts=between_blocks)
    if sequence_parallel:
        # Norms see sequence-sharded activations (absent ones are nn.Identity); a post-norm's output joins the
        # residual stream, which is a plain (sequence-sharded) tensor.
        for norm in ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm"):
            if not isinstance(getattr(block, norm), nn.Identity):
                plan[norm] = SequenceParallel(use_local_output=norm.startswith("post"))
    # QK-norm inside attention sees this rank's heads, in dim 2 either way: of (batch, seq, heads, head_dim)
    # per head, of (batch, seq, heads * head_dim) across heads (OLMo 2), where DTensor reduces the mean over
    # the ranks. The weight is a replicated DTensor, so its gradient is summed over the ranks.
    if block.attention.qk_norm != "none":
        for norm in ("attention.q_norm", "attention.k_norm"):
            plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def uses_loss_parallel(model: nn.Module) -> bool:
    """True when the logits come out as a vocabulary-sharded DTensor (TP, with an untied or a tied head)."""
    from torch.distributed.tensor import DTensor

    output = getattr(model, "output", None)
    head = output if output is not None else model.tok_embeddings
    if head is None:  # a pipeline rank with neither the first nor the last stage computes no loss
        return False
    weight = head.weight
    return isinstance(weight, DTensor) and "tp" in (weight.device_mesh.mesh_dim_names or ())


# Ops whose outputs selective checkpointing keeps: recomputing them costs the most. Context parallel's K/V
# all-gather too: recomputed, each layer's gather would run again in backward, on the critical path (its output,
# 2 x seq x kv_heads x head_dim per layer, is what the memory table of docs/context-parallel.md counts).
_SAVE_OPS = {
    torch.ops.maester.cp_all_gather.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,  # biased linears (GPT-NeoX); torchtitan saves aten.linear too
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


@cache
def _saved_ops() -> frozenset:
    """`_SAVE_OPS` with the grouped GEMM, FlexAttention and variable-length attention, where this torch has them.
    The attention modules are imported at the first selective checkpoint, not with this one: they load
    torch._dynamo."""
    ops = {torch.ops.aten._grouped_mm.default} if hasattr(torch.ops.aten, "_grouped_mm") else set()
    try:
        import torch.nn.attention.flex_attention as _flex  # noqa: F401 (registers the op)
        ops.add(torch.ops.higher_order.flex_attention)
    except (ImportError, AttributeError):
        pass
    try:
        import torch.nn.attention.varlen as _varlen  # noqa: F401 (registers the op)
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    return frozenset(_SAVE_OPS | ops)


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpointing_needs_compile(parallel: ParallelConfig, args, document_masking: bool, seq_len: int,
                                          device_type: str) -> bool:
    """Whether selective activation checkpointing would run eagerly around FlexAttention's separately compiled
    kernel on CUDA: a combination that errors or recomputes flex (pytorch#147879; torchtitan warns on it). Then the
    blocks must be compiled with it. `args`: the model's TransformerArgs. Under context parallel the local queries
    never see the same keys, so `auto` always takes flex on CUDA (`layers.context_parallel_mask`)."""
    if parallel.activation_checkpointing != "selective-op" or parallel.compile or device_type != "cuda":
        return False
    if args.attention == "flex":
        return True
    window = args.sliding_window
    masked = (document_masking or parallel.cp > 1 or (window is not None and window < seq_len)
              or args.attn_logit_softcap is not None)
    return args.attention == "auto" and masked


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """`full`: recompute the whole block in backward; `selective-op`: keep matmul and attention outputs."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for i, (name, block) in enumerate(model.layers.named_children()):
        if i % every:
            continue
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False,
                                         context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
        model.layers.register_module(name, wrapped)


def apply_compile(model: nn.Module) -> None:
    """Compile each transformer block on its own: short compiles, one graph reused by every block. A block with a
    mixture of experts may break its graph: the expert loop reads the group sizes on the host (the CPU's dispatch),
    which fails a fullgraph compile at step 1."""
    for name, block in model.layers.named_children():
        whole = not any(isinstance(m, MoEFeedForward) for m in block.modules())
        model.layers.register_module(name, torch.compile(block, fullgraph=whole))


def reshards_after_forward(cfg: ParallelConfig, pipelined: bool) -> bool:
    """`parallel.fsdp_reshard_after_forward`, its default (None) resolved: not under pipeline parallel, where every
    micro-batch's forward and backward would all-gather each block again (torchtitan's
    `get_fsdp_reshard_after_forward_policy`: "default" is `not pp_enabled`)."""
    return cfg.fsdp_reshard_after_forward if cfg.fsdp_reshard_after_forward is not None else not pipelined


def apply_fsdp(model: nn.Module, mesh, cfg: ParallelConfig, device: torch.device,
               precision: Precision | None = None, experts_mesh=None, experts_divide: int = 1,
               pipelined: bool = False) -> None:
    """FSDP2 per block, then the root; the mixed-precision policy computes in the precision's dtype (and is the
    only cast: the trainer runs no autocast under FSDP). `experts_mesh`: under expert parallel, the mesh the
    experts of each block are sharded over first, as their own FSDP unit whose gradients are divided by
    `experts_divide`. `pipelined`: `model` is a pipeline stage (see `reshards_after_forward`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if precision is None:
        precision = resolve_precision("auto", cfg.param_dtype, device.type, fsdp=True)
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=precision.fsdp_param_dtype,
                                          reduce_dtype=DTYPES[cfg.reduce_dtype]),
        "offload_policy": CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
    }
    resharding = reshards_after_forward(cfg, pipelined)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: no point resharding them.
        reshard = resharding and i < len(blocks) - 1
        for moe in moe_layers(block) if experts_mesh is not None else ():
            fully_shard(moe.experts, reshard_after_forward=reshard, **{**kwargs, "mesh": experts_mesh})
            moe.experts.set_gradient_divide_factor(float(experts_divide))
            # Divide after a sum (gloo has no PREMUL_SUM), unless the experts are not sharded (one rank on the
            # last dim): there FSDP divides in its copy, and forcing would divide a second time.
            if experts_mesh.size(experts_mesh.ndim - 1) > 1:
                moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root (embeddings, final norm, output) keeps FSDP2's default, None: not resharded after forward, since
    # backward needs the output layer first; an explicit True would all-gather it again in every backward.
    fully_shard(model, reshard_after_forward=None if resharding else False, **kwargs)
