"""The sections of the config tree that watch a run rather than shape it: metrics logging and its sinks
(`logging`, `tensorboard`, `wandb`), downstream evaluation, profiling and the collectives' preflight."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maester.config.base import Section


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
