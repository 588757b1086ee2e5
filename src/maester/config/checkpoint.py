"""The checkpoint section of the config tree (`checkpoint`): how often a run saves, what it keeps, and which
parts of `init_from` a new run takes (`LOAD_MODES`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maester.config.base import Section


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
