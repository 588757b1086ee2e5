"""The config tree: one typed, strictly validated, round-trippable object for a whole run, assembled from its
sections. Where the values come from is `config_sources`; the section base and the error messages are
`config_base`; the model's sections live beside the models (`models/config.py`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from maester.config_base import ConfigError, Section  # noqa: F401 (ConfigError: what importers of the tree catch)
from maester.config_data import DataConfig, DataSourceConfig, SFTConfig, TokenizerConfig  # noqa: F401 (re-exported)
from maester.config_job import JobConfig, SlurmConfig
from maester.config_optim import (DECOUPLED_DECAY, OPTIMIZER_NAMES, MuonConfig, OptimizerConfig,  # noqa: F401
                                  ParamGroupRule, ScheduleConfig)
from maester.config_sources import load
from maester.models.args import MupConfig
from maester.models.config import ModelConfig


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


LOAD_MODES: dict[str, frozenset[str]] = {
    "continue": frozenset({"model", "optimizer", "schedule", "data", "step"}),
    "model_only": frozenset({"model"}),
    "model_data": frozenset({"model", "data"}),
    "model_opt_data": frozenset({"model", "optimizer", "data"}),
    "reset_optimizer": frozenset({"model", "schedule", "data", "step"}),
    "transfer": frozenset({"model", "optimizer"}),
    "transfer_with_lr": frozenset({"model", "optimizer", "schedule", "step"}),
    "cooldown": frozenset({"model", "optimizer", "data", "step"}),
    "model_partial": frozenset({"model"}),
}
"""The parts of `checkpoint.init_from` each `checkpoint.load_mode` takes; every other part starts fresh."""

PARTIAL_LOAD_MODES = frozenset({"model_partial"})
"""Load modes that take the weights a checkpoint and the model share by name, from any architecture; the others
refuse a checkpoint of another `model.name` or with other weights."""


HF_PREFIX = "hf:"
"""`checkpoint.init_from = "hf:PATH"` names a Hugging Face model directory instead of a checkpoint."""


class CheckpointConfig(Section):
    interval: int = Field(500, ge=0)
    """Save every this many steps (0: only at the end)."""
    keep_last: int = Field(2, ge=1)
    keep_every: int | None = Field(None, gt=0)
    """Also keep every checkpoint whose step is a multiple of this, forever."""
    init_from: str | None = None
    """A checkpoint directory (or job directory) that starts a new run; used only while the job has no
    checkpoint of its own (a restarted job resumes from its own latest checkpoint, never again from this).
    `hf:PATH`: the weights of a Hugging Face model directory (config.json + safetensors), whose architecture must
    be the run's (`model.hf_config = PATH` takes it); it holds only weights, so only `model_only` applies."""
    load_mode: Literal["continue", "model_only", "model_data", "model_opt_data", "reset_optimizer", "transfer",
                       "transfer_with_lr", "cooldown", "model_partial"] = "model_only"
    """Which parts of `init_from` the run takes (`LOAD_MODES`); the rest start fresh. `continue`: model,
    optimizer state, schedule, data position, step (and the RNG state); `model_only`: the weights (fine-tuning);
    `model_data`: + data position; `model_opt_data`: + optimizer state and data position; `reset_optimizer`: all
    but the optimizer state; `transfer`: weights and optimizer state; `transfer_with_lr`: weights, optimizer
    state, schedule and step; `cooldown`: all but the schedule, from a checkpoint in the stable phase of its
    schedule (a WSD run's), and this run's schedule (no warmup) decays from that step to `training.steps`;
    `model_partial`: the weights the checkpoint and this model share by name, whatever architecture saved it (the
    others start fresh; every other mode refuses a checkpoint of another `model.name` or with other weights)."""
    step_offset: int = Field(0, ge=0)
    """The step a run starts at when it does not take the step from `init_from`; its schedule (warmup
    included) still starts at that step. `training.steps` stays the number of the last step: an offset of 220 with
    `training.steps = 250` trains 30 steps."""
    save_final: bool = True
    verify: Literal["size", "full"] = "full"
    """What a run checks of the checkpoint it resumes from (or `init_from`) against its manifest.json: `full`, every
    file's size and checksum (XXH3-128; CRC-32 in a manifest written before format 2), at a resume on the bytes the
    load reads, in the same pass, every rank its share (docs/checkpoints.md has the cost); `size`, every file's size
    only (a stat per file), which misses a flipped bit. A damaged checkpoint is moved aside and the one before it
    loaded. Either way the first steps after a load stop the run if the model cannot train."""
    trust_pickled_rng: bool = False
    """Read a checkpoint's RNG state saved by an older maester (pickled Python objects: loading them can run
    code). Off: such a file is refused with a message; checkpoints of this version hold no pickle."""
    async_mode: Literal["auto", "off", "async", "pinned"] = "auto"
    """How the interval saves are written. `off`: the loop waits until the checkpoint is on disk. `async`: the loop
    waits only while the state is copied to host buffers (as much again as a rank's model and optimizer state, kept
    and refilled from save to save); a thread writes it, with its collectives on a gloo group of their own. `pinned`:
    as `async`, into page-locked buffers, for faster copies from a GPU (CUDA only; refused elsewhere). One save at a
    time: a save waits for the previous one. The last step's save and the save of a stop (SIGTERM, SIGUSR1, the
    stop file) are written before the run goes on or exits. A background write that fails is logged and recorded
    in events.jsonl, `latest` stays where it was, training goes on and the next interval saves again; a run whose
    last save failed exits with an error. `auto`: `async` on CUDA, `off` elsewhere. Before step 1 the host copies of
    each node's ranks are sized (`maester.train.checkpoint_memory.staged_bytes`) against 3/4 of the node's available
    memory: where they do not fit, `auto` saves synchronously and says so in one line, and `async` or `pinned` is
    refused."""

    @property
    def init_from_hf(self) -> str | None:
        """The Hugging Face directory of `init_from = "hf:PATH"`; None when `init_from` is not one."""
        if self.init_from is None or not self.init_from.startswith(HF_PREFIX):
            return None
        return self.init_from[len(HF_PREFIX):]

    @property
    def init_from_path(self) -> str | None:
        """The directory `init_from` names, a checkpoint or a Hugging Face directory."""
        return self.init_from_hf if self.init_from_hf is not None else self.init_from

    @model_validator(mode="after")
    def _check_load_mode(self) -> "CheckpointConfig":
        if self.init_from_hf is not None:
            if not self.init_from_hf:
                raise ValueError(f"checkpoint.init_from = {self.init_from!r}: give the Hugging Face model directory "
                                 f"after {HF_PREFIX!r}")
            taken = LOAD_MODES[self.load_mode] - {"model"}
            if self.load_mode in PARTIAL_LOAD_MODES:
                raise ValueError(f"checkpoint.load_mode = {self.load_mode!r} takes part of a checkpoint, and "
                                 f"{self.init_from!r} is a Hugging Face directory, whose weights load whole: use "
                                 f"load_mode = 'model_only'")
            if taken:
                raise ValueError(f"checkpoint.load_mode = {self.load_mode!r} takes the {', '.join(sorted(taken))} "
                                 f"of checkpoint.init_from, but {self.init_from!r} is a Hugging Face directory, "
                                 f"which holds only weights: use load_mode = 'model_only'")
        if self.load_mode != "model_only" and not self.init_from:
            raise ValueError(f"checkpoint.load_mode = {self.load_mode!r} needs checkpoint.init_from (the "
                             "checkpoint to load from)")
        if self.step_offset and "step" in LOAD_MODES[self.load_mode]:
            raise ValueError(f"checkpoint.step_offset = {self.step_offset} conflicts with checkpoint.load_mode = "
                             f"{self.load_mode!r}, which takes the step from checkpoint.init_from")
        return self


class TensorBoardConfig(Section):
    enabled: bool = False
    """Write the metrics as TensorBoard event files under `<job dir>/tensorboard` (needs the `tensorboard` extra),
    one scalar per record key (`loss`, `lr/<group>`, ...). A restart drops the steps the previous attempt logged after
    its last checkpoint, so each step appears once."""


class WandbConfig(Section):
    enabled: bool = False
    """Log the metrics to Weights & Biases (needs the `wandb` extra); the run id is kept in
    `<job dir>/wandb/run-id`, so a restart or requeue continues the same run."""
    project: str | None = None
    """Default: `$WANDB_PROJECT`, else `maester`."""
    entity: str | None = None
    """Default: `$WANDB_ENTITY`, else the account's default. Both may come from a `.env` file in the working
    directory, which every command reads (variables already set win; its values never enter config.json)."""
    name: str | None = None
    """The run's display name; default: `job.name`."""
    group: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline"] = "online"
    """`offline`: write the run under `<job dir>/wandb` only (no network), for `wandb sync` later."""
    init_timeout: float = Field(90.0, gt=0)
    """Seconds an online run waits for the W&B server to start or resume the run; then the job fails with an error."""


class LoggingConfig(Section):
    interval: int = Field(10, gt=0)
    eval_interval: int = Field(0, ge=0)
    """Every this many steps (and at the last), the loss on the sources' held-out `validation_fraction` is
    logged as `val_loss` (and `val_perplexity`); 0: never."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    per_rank_files: bool = False
    """Every rank writes its own full log to `logs/rank-<R>.log`; otherwise only rank 0 logs (to the console and
    `logs/train.log`) and the other ranks report warnings and errors."""


class EvaluationConfig(Section):
    """Downstream tasks of EleutherAI's lm-evaluation-harness, run in the training loop on the model as training
    shards it (FSDP, TP; no copy gathered on one rank) every `interval` steps and at the last step; needs the `eval`
    extra. Each task's metrics are logged as `eval/<task>/<metric>` (metrics.jsonl, TensorBoard, W&B); a task that
    fails is logged (an `eval_failed` event, and the error on the console) and training goes on. Their time is not
    the steps' (tokens/s). The validation loss on held-out data is `logging.eval_interval`'s; `maester eval` runs the
    same tasks on a checkpoint (docs/evaluation.md)."""

    tasks: list[str] = Field(default_factory=list)
    """lm-eval task, group or tag names (`hellaswag`, `arc_easy`), or task YAML files (paths ending in `.yaml`).
    `pydoc_choice` (multiple choice) and `pydoc_complete` (generation) ship with maester and need no download."""
    interval: int = Field(0, ge=0)
    """Evaluate every this many steps, and at the last step; 0: at the last step only."""
    limit: int | float | None = Field(None, gt=0)
    """At most this many documents per task (below 1: that share of them); None: all of them."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples in each prompt; None: each task's own default."""
    batch_size: int = Field(8, gt=0)
    """Requests per forward on each data-parallel rank."""


class ProfilingConfig(Section):
    """torch profiler traces and CUDA memory snapshots, written under `<job dir>/profiles`."""

    enabled: bool = False
    """Trace the steps `start_step` .. `start_step + steps - 1` (after `warmup_steps` untraced warm-up steps) on
    every rank: `profiles/step-<N>/rank-<R>.trace.json.gz`, for Perfetto or TensorBoard. A run resumed after these
    steps takes no trace; one resumed inside them traces the rest; a run that ends inside them writes what it has."""
    start_step: int = Field(5, ge=1)
    """The first traced step (global step number, 1-based)."""
    steps: int = Field(3, ge=1)
    """How many steps to trace."""
    warmup_steps: int = Field(1, ge=0)
    """Steps run under the profiler just before `start_step` but not recorded, so that its start-up cost stays out
    of the trace; fewer when `start_step` is near the start of the run."""
    record_shapes: bool = False
    """Record the input shapes of every op (`torch.profiler.profile(record_shapes=...)`)."""
    profile_memory: bool = False
    """Record tensor allocations and frees in the trace (`profile_memory=...`)."""
    with_stack: bool = False
    """Record the Python source location of every op (`with_stack=...`); larger traces."""
    memory_snapshot: bool = False
    """CUDA only: record allocator history from the start and dump it as `profiles/memory/rank-<R>-step-<N>.pickle`
    after the traced window (`enabled` is not needed) and as `rank-<R>-oom-step-<N>.pickle` when step N runs out
    of memory (view at pytorch.org/memory_viz)."""
    memory_snapshot_max_entries: int = Field(100_000, gt=0)
    """How many allocator events the history keeps (the latest); each takes a few KB in the snapshot."""


class PreflightConfig(Section):
    """Communication checks (`maester preflight`, and before training when `enabled`): all-reduce, all-gather and
    reduce-scatter on the job's process group, each result checked exactly against its analytic value and timed."""

    enabled: bool = False
    """Run the checks before training, after the process group is up and before the model is built."""
    fail_fast: bool = True
    """Before training: stop the job at the first wrong result instead of reporting it and training anyway
    (`maester preflight` takes `--fail-fast` instead). A check that hangs past `timeout_s` always stops the job."""
    timeout_s: float = Field(120.0, gt=0)
    """The longest one check (one collective, dtype and size: warmup, checks and timed iterations) may take."""
    sizes: list[int] = Field(default_factory=lambda: [1024, 1 << 20, 32 << 20, 256 << 20], min_length=1)
    """Buffer sizes in bytes, as nccl-tests counts them: the all-reduce buffer, the all-gather output, the
    reduce-scatter input (`maester preflight --sizes` also takes 64K, 32MiB, 1G)."""
    dtypes: list[Literal["float32", "bfloat16", "float16"]] = Field(
        default_factory=lambda: ["float32", "bfloat16", "float16"], min_length=1)
    iterations: int = Field(20, ge=1)
    """Timed calls of each collective per dtype and size, after a few untimed warmup calls."""

    @model_validator(mode="after")
    def _check_lists(self) -> "PreflightConfig":
        bad = [s for s in self.sizes if s <= 0]
        if bad:
            raise ValueError(f"preflight.sizes: sizes are positive numbers of bytes, got {bad[0]}")
        for key in ("sizes", "dtypes"):
            values = getattr(self, key)
            if len(set(values)) != len(values):
                raise ValueError(f"preflight.{key} lists {values}: each value once")
        return self


class Config(Section):
    job: JobConfig = Field(default_factory=JobConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    mup: MupConfig = Field(default_factory=MupConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @model_validator(mode="after")
    def _check_batch(self) -> "Config":
        t, seq_len = self.training, self.data.seq_len
        if t.batch_unit == "tokens":
            for key in ("global_batch_size", "micro_batch_size"):
                if getattr(t, key) % seq_len:
                    raise ValueError(f"training.{key} = {getattr(t, key)} tokens is not a multiple of "
                                     f"data.seq_len = {seq_len}")
        if t.global_batch_size % t.micro_batch_size:
            raise ValueError(f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                             f"training.micro_batch_size ({t.micro_batch_size})")
        if self.checkpoint.load_mode == "cooldown" and (self.schedule.warmup_steps or self.schedule.warmup_fraction):
            key, value = (("warmup_fraction", self.schedule.warmup_fraction) if self.schedule.warmup_fraction
                          else ("warmup_steps", self.schedule.warmup_steps))
            raise ValueError(f"schedule.{key} = {value} with checkpoint.load_mode = 'cooldown': a cooldown continues "
                             f"at the stable LR, set schedule.warmup_steps = 0")
        offset = self.checkpoint.step_offset
        if offset >= t.steps:
            raise ValueError(f"checkpoint.step_offset = {offset} leaves nothing to train with training.steps = "
                             f"{t.steps}: training.steps is the number of the last step, not a count after the offset "
                             f"(GPT-NeoX's train_iters with iteration_offset); to train {t.steps} steps after step "
                             f"{offset}, set training.steps = {offset + t.steps}")
        held_out = any(s.validation_fraction for s in self.data.sources) or self.data.validation
        if self.logging.eval_interval and not held_out:
            raise ValueError("logging.eval_interval is set, but no data source holds out a validation split "
                             "(set validation_fraction on a source, or add data.validation sources)")
        if self.data.validation and not self.logging.eval_interval:
            raise ValueError("data.validation names sources to evaluate, but logging.eval_interval is 0 (never)")
        self._check_evaluation()
        return self

    @model_validator(mode="after")
    def _check_float8(self) -> "Config":
        """The float8 settings that the config alone refuses (`maester.parallel.float8.check_float8` refuses the
        rest, which needs the devices, the layout and the installed torchao)."""
        f8, precision = self.training.float8, self.training.precision
        if not f8.enabled:
            return self
        if precision in ("fp16", "bf16-pure"):
            why = ("fp16 is for GPUs without bf16, and every GPU with float8 matmuls has bf16; its loss scaling is "
                   "not made for float8's own dynamic scales" if precision == "fp16" else
                   "it keeps no fp32 master weights, so the float8 casts would start from bf16-rounded weights and "
                   "updates below bf16's resolution would be lost on top of float8's rounding")
            raise ValueError(f"training.float8 with training.precision = {precision!r}: {why}. torchao and "
                             f"torchtitan train float8 in bf16 mixed precision: set training.precision = 'bf16'")
        if not self.parallel.compile and not f8.emulate:
            raise ValueError("training.float8 needs parallel.compile = true: torch.compile fuses torchao's amax, "
                             "scale and cast kernels around each float8 matmul; run eagerly, they read and write "
                             "every activation and weight again and cost more than float8 saves (torchtitan "
                             "requires compile for float8 too)")
        if f8.experts:
            raise ValueError("training.float8.experts = true: float8 grouped GEMMs for the routed experts are not "
                             "supported with the pinned torchao (a prototype, torchao.prototype.moe_training, whose "
                             "GPU-only Triton kernels need every expert's token group padded to a multiple of 16, "
                             "which maester's routing does not do); set it to false: the experts compute in bf16 "
                             "and the other linears of the blocks in float8")
        if any(not entry.strip() for entry in f8.filter):
            raise ValueError("training.float8.filter has an empty entry, which every layer name contains")
        return self

    def _check_evaluation(self) -> None:
        e, p = self.evaluation, self.parallel
        if not e.tasks:
            if e.interval:
                raise ValueError(f"evaluation.interval = {e.interval}, but evaluation.tasks names no task")
            return
        for key in ("cp", "pp"):
            if getattr(p, key) > 1:
                raise ValueError(f"evaluation.tasks: in-loop downstream evaluation runs on FSDP, HSDP, DDP and TP "
                                 f"layouts, not with parallel.{key} = {getattr(p, key)}: evaluate the checkpoints "
                                 f"with `maester eval` instead")

    @property
    def job_dir(self) -> Path:
        return Path(self.job.dump_dir) / self.job.name

    def sequences(self, size: int) -> int:
        """A batch size of `training.batch_unit` in sequences of `data.seq_len`."""
        return size // self.data.seq_len if self.training.batch_unit == "tokens" else size

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    @classmethod
    def from_json_file(cls, path: str | Path) -> "Config":
        return load_config(path, overrides=(), environ={})


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """The run's config from defaults, a file, the environment and command-line overrides."""
    return load(Config, path, overrides, environ)
