"""What a run that starts from another checkpoint (`checkpoint.init_from` with a `load_mode`) checks before it loads
anything: steps left to train, and for a cooldown a source checkpoint in the stable phase of its schedule."""

from __future__ import annotations

import logging
from pathlib import Path

from maester.config import LOAD_MODES, Config
from maester.train.checkpoint import resolve_checkpoint
from maester.train.checkpoint_files import read_trainer_state
from maester.train.schedule import lr_multiplier

log = logging.getLogger("maester")


def resolve_init_from(cfg: Config) -> Path | None:
    """The checkpoint `checkpoint.init_from` names (None: none, or a Hugging Face directory), resolved once, at
    `checkpoint.verify`: a damaged candidate of a job directory is skipped with one warning."""
    c = cfg.checkpoint
    if not c.init_from or c.init_from_hf is not None:
        return None
    return resolve_checkpoint(c.init_from, c.verify)


def check_steps_left(cfg: Config, source: Path | None) -> None:
    """A run that takes its step from `source` (`checkpoint.init_from`) must have steps left before
    `training.steps`, the number of its last step; checked from the checkpoint's trainer_state.json, before anything
    is loaded. (A `checkpoint.step_offset` past the end is refused with the config.)"""
    c, total = cfg.checkpoint, cfg.training.steps
    if source is None or "step" not in LOAD_MODES[c.load_mode]:
        return
    step = read_trainer_state(source)["step"]
    if step >= total:
        raise ValueError(f"checkpoint.init_from {source} is at step {step} and checkpoint.load_mode = {c.load_mode!r} "
                         f"continues from it, but training.steps = {total}: training.steps is the number of the last "
                         f"step, not a count; to train {total} more steps, set training.steps = {step + total}")


def check_stable_phase(source: Path, cfg: Config) -> None:
    """A cooldown starts where the source run's LR stood at its peak; refuse a checkpoint taken in its warmup or
    decay, and say so where the cooldown's base LR differs from the source's."""
    state = read_trainer_state(source)
    source_cfg = Config.from_json_file(source / "config.json")
    step, start = state["step"], state.get("schedule_start", 0)
    mult = lr_multiplier(source_cfg.schedule, step - start, source_cfg.training.steps - start)
    if mult != 1.0:
        raise ValueError(f"checkpoint.load_mode = 'cooldown': {source} (step {step}) is not in the stable phase of "
                         f"its schedule ({source_cfg.schedule.name}): its LR multiplier there is {mult:.4g}, not 1")
    if source_cfg.optimizer.lr != cfg.optimizer.lr:
        log.warning("cooldown from %s: optimizer.lr is %g here and was %g there", source, cfg.optimizer.lr,
                    source_cfg.optimizer.lr)
