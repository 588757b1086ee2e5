"""The config tree: one typed, strictly validated, round-trippable object for a whole run, assembled from its
sections (the sibling modules of this package, and the model's sections beside the models in `models/config.py`),
with the checks that span sections. Where the values come from is `sources`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field, model_validator

from maester.config.base import Section
from maester.config.checkpoint import CheckpointConfig
from maester.config.data import DataConfig, TokenizerConfig
from maester.config.job import JobConfig, SlurmConfig
from maester.config.observability import EvaluationConfig, LoggingConfig, PreflightConfig, ProfilingConfig
from maester.config.optim import OptimizerConfig, ScheduleConfig
from maester.config.sources import load
from maester.config.training import ParallelConfig, TrainingConfig
from maester.models.args import MupConfig
from maester.models.config import ModelConfig


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
