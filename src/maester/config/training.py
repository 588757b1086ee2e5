"""The training sections of the config tree: the loop's own settings (`training`, with its `float8`) and how the
job is spread over ranks (`parallel`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maester.config.base import Section


class Float8Config(Section):
    """Float8 matmuls in the transformer blocks through torchao (the `float8` extra: `pip install maester[float8]`),
    after torchtitan's Float8LinearConverter; `maester.parallel.float8` converts and checks. Needs a GPU with float8
    matmuls (NVIDIA SM 8.9+: L4, L40, H100, H200, B200; AMD gfx942 MI300, gfx950 MI350), `parallel.compile = true`
    and `training.precision = "bf16"` (or `auto` on a GPU). Checkpoints hold the same high-precision weights as
    without float8."""

    enabled: bool = False
    """Convert the `nn.Linear` layers of the transformer blocks to torchao's `Float8Linear` before they are
    parallelised. The output layer, MoE routers, the layers in `filter` and layers whose dims (per tensor-parallel
    shard) are not multiples of 16 stay in high precision; MoE routed experts stay bf16 (`experts`)."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao's scaling recipe. `tensorwise`: one dynamic scale per tensor (the fastest; under FSDP the weights are
    all-gathered in float8 and their scales computed for all layers in one all-reduce after each optimizer step;
    under TP torchao's float8 TP styles all-gather activations in float8). `rowwise`: a scale per row, more
    accurate, all-gathers in high precision. `rowwise_with_gw_hp`: rowwise, with the weight gradient computed in
    high precision."""
    filter: list[str] = Field(default_factory=list)
    """Further layers to keep in high precision: a layer whose name contains an entry stays (torchtitan's
    filter_fqns), e.g. `["attention.k_proj", "attention.v_proj"]` (too small to gain at some widths); names as in
    checkpoints (`layers.3.feed_forward.down_proj`). An entry that names no converted layer is an error."""
    emulate: bool = False
    """For tests on the CPU only: float8 rounding emulated in high-precision matmuls (torchao's `emulate`), and
    `parallel.compile` not required (compiling on the CPU is slow). Refused on a GPU."""
    experts: bool = False
    """Float8 grouped GEMMs for the routed experts of MoE layers. Refused: the pinned torchao has them only as a
    prototype (`torchao.prototype.moe_training`) with GPU-only Triton kernels that need every expert's token group
    padded to a multiple of 16, which maester's routing does not do; the experts compute in bf16."""


class TrainingConfig(Section):
    steps: int = Field(1000, gt=0)
    """The number of the last step (absolute: a run resumed or started at `checkpoint.step_offset` ends there too)."""
    seed: int = 0
    batch_unit: Literal["sequences", "tokens"] = "sequences"
    global_batch_size: int = Field(32, gt=0)
    """Per optimizer step, over all data-parallel ranks, in `batch_unit`."""
    micro_batch_size: int = Field(8, gt=0)
    """Per forward/backward on one rank, in `batch_unit`; accumulation steps are derived."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; None: no clipping (the norm is still logged)."""
    precision: Literal["auto", "fp32", "bf16", "bf16-pure", "fp16"] = "auto"
    """`fp32`; `bf16`: bf16 compute with fp32 parameters and optimizer state (FSDP mixed precision, else
    autocast); `bf16-pure`: parameters and optimizer state in bf16 too (half the memory, no fp32 master
    weights); `fp16`: fp16 compute with dynamic loss scaling (GPUs without bf16). `auto`: bf16 on GPU, fp32 on
    CPU. See `maester.parallel.precision`."""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """`auto`: CUDA/ROCm where a GPU is usable, else the CPU (refused where the run was meant for GPUs). `mps`:
    Apple Silicon's GPU, for one process (no distributed backend serves it); refused where MPS is absent."""
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    """`torch.set_float32_matmul_precision`: `high` lets float32 matmuls use TF32 on Ampere and later GPUs (faster,
    about 10 mantissa bits); `highest` (torch's default) keeps full float32."""
    cpu_threads: int | None = Field(None, gt=0)
    """Intra-op threads of each process of a CPU run (`torch.set_num_threads`). None: the CPUs the process may use
    (its affinity mask, at most its cgroup CPU quota, which torch does not see), at most torch's default (the
    physical cores) for one process; for N processes of a torchrun on one machine, those CPUs / N each (torchrun
    would give each one thread). GPU runs leave torch's setting."""
    deterministic: bool = False
    """Use deterministic kernels (`torch.use_deterministic_algorithms`); CPU runs are bitwise repeatable anyway."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is not finite: `stop` ends the run with an error naming the step and
    saves no checkpoint after it; `skip` drops that step's update, counts it (`skipped_steps`) and goes on. Found
    on the device, read on the host at logging steps and before checkpoints (no sync per step)."""
    max_skipped_steps: int = Field(100, ge=0)
    """With `nonfinite = "skip"`: stop as `stop` does once more steps than this were skipped."""
    detect_anomaly: bool = False
    """Debugging: `torch.autograd.detect_anomaly` names the backward op that made the first NaN (slow)."""
    gc_interval: int = Field(50, ge=0)
    """Python's garbage collector is off in the training loop and runs every this many steps on every rank at
    once; 0: leave it on, as Python has it."""
    init_timeout_seconds: float = Field(600, gt=0)
    """Collective timeout until the first step is done (building, loading, compiling)."""
    train_timeout_seconds: float = Field(300, gt=0)
    """Collective timeout after the first step: a hung rank ends the job within this."""
    float8: Float8Config = Field(default_factory=Float8Config)
    """Float8 training through torchao (see `Float8Config`)."""
    requeue_lock_wait_seconds: float = Field(600, ge=0)
    """A requeued SLURM job (SLURM_RESTART_COUNT > 0) waits this long for the previous run of its job directory to
    release `run.lock` (it may still be saving); any other second run of a job directory is refused at once."""


class ParallelConfig(Section):
    """How the job is spread over ranks: world = pp x dp_replicate x dp_shard x cp x tp.

    dp_shard > 1: FSDP2 (HSDP when dp_replicate > 1 too); dp_replicate > 1 alone: DDP; tp > 1: tensor and
    sequence parallel with loss-parallel cross-entropy, combinable with FSDP/HSDP. cp > 1: the sequence split over
    ranks (context parallel); pp > 1: the layers split into pipeline stages; ep > 1: a mixture of experts' experts
    split over ep of the dp_shard ranks (expert parallel, no ranks of its own).
    """

    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(-1, ge=-1)
    """-1: all remaining ranks."""
    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    """Context parallel degree: each rank of a cp group holds 1/cp of every sequence (two of 2 x cp chunks, so
    data.seq_len must be a multiple of 2 x cp) and attends over all of it (docs/context-parallel.md)."""
    pp: int = Field(1, ge=1)
    """Pipeline parallel degree: the number of pipeline ranks the layers are split over."""
    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"] = "1F1B"
    """The pipeline schedule (torch.distributed.pipelining): 1F1B and GPipe run one stage per rank;
    Interleaved1F1B and ZBVZeroBubble two (or, Interleaved1F1B, as many as `pp_layers` gives)."""
    pp_layers: list[int] | None = None
    """Layers of each pipeline stage, first to last (one entry per stage: pp x stages per rank; they sum to
    n_layers); None: an even split, the earlier stages taking one more where it does not divide."""
    ep: int = Field(1, ge=1)
    """Expert parallel degree (MoE models): divides dp_shard; the experts are split over ep ranks."""
    fsdp_reshard_after_forward: bool | None = None
    """True: full shard (ZeRO-3); False: shard-grad-op (ZeRO-2, parameters stay gathered until backward). None:
    True, except under pipeline parallel (pp > 1), where resharding would gather every block again in each
    micro-batch's forward and backward (torchtitan's default)."""
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """FSDP compute dtype of parameters; `auto`: the one `training.precision` computes in (another value must
    agree with it)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP gradient reduction dtype."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in CPU memory."""
    force_fsdp: bool = False
    """Apply FSDP2 where dp_shard is 1 too (one process: a one-rank mesh): mixed precision by FSDP's policy rather
    than autocast, `cpu_offload` on one GPU, and, on one GPU, the code path that multi-GPU runs take (the GPU check
    uses it)."""
    activation_checkpointing: Literal["none", "full", "selective-op"] = "none"
    activation_checkpointing_every: int = Field(1, ge=1)
    """Checkpoint every N-th transformer block (1: all of them)."""
    compile: bool = False
    """`torch.compile` each transformer block."""

    @model_validator(mode="after")
    def _check_shard(self) -> "ParallelConfig":
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard must be -1 (the remaining ranks) or >= 1, got 0")
        return self
