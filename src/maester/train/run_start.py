"""Where a run starts, once the trainer is built: the job's own latest checkpoint (a resume, with everything in
it), else the job's seed checkpoint, else the parts of `checkpoint.init_from` that `checkpoint.load_mode` names (of
an `hf:` directory, the weights only), else nothing (fresh, at `checkpoint.step_offset`). A load is watched for its
first steps (`AfterLoadWatch`) and told in events.jsonl (`load`)."""

from __future__ import annotations

import logging
from pathlib import Path

from maester.config import LOAD_MODES
from maester.train.checkpoint import resolve_checkpoint
from maester.train.hf_weights import load_hf_weights
from maester.train.init_from import check_stable_phase
from maester.train.nonfinite import AfterLoadWatch

log = logging.getLogger("maester")


def start(t) -> dict | None:
    """Set the model, optimizer, step, tokens seen, data position, schedule start, provenance and watch of the
    trainer `t` for its run; the `load` event of what was loaded, None for a fresh start."""
    c, latest = t.cfg.checkpoint, t._latest
    if t._resuming:
        latest, state = t.checkpointer.resume(latest, t.model, t.optimizer, t.cfg.model.name)
        take_trainer_state(t, state, LOAD_MODES["continue"])
        t.after_load = watch_after_load(t, latest)
        t.provenance = {k: state[k] for k in ("init_from", "load_mode") if k in state}
        log.info("resumed from %s at step %d", latest, t.step)
        return load_event(t, latest, "continue")
    if latest is not None:
        if c.init_from:
            raise ValueError(f"{t.job_dir} has the seed checkpoint {latest} and checkpoint.init_from is set "
                             f"too: start from one of them")
        t.checkpointer.load(latest, t.model, t.optimizer, "model_only", t.cfg.model.name)
        take_trainer_state(t, {}, LOAD_MODES["model_only"])
        t.after_load = watch_after_load(t, latest)
        log.info("initialised model weights from the seed checkpoint %s", latest)
        return load_event(t, latest, "seed")
    if c.init_from_hf is not None:
        source = c.init_from_hf  # a directory or a Hub id, resolved where it is read
        load_hf_weights(source, t.model, t.cfg.model.name, f"checkpoint.init_from = {c.init_from!r}")
        take_trainer_state(t, {}, LOAD_MODES["model_only"])
        t.provenance = {"init_from": c.init_from, "load_mode": c.load_mode}
        log.info("initialised the model weights from the Hugging Face directory %s; fresh: optimizer, schedule, "
                 "data, step; first step %d", source, t.step + 1)
        return load_event(t, source, "hf")
    if c.init_from:
        return _init_from(t, resolve_checkpoint(c.init_from, c.verify), c.load_mode)
    take_trainer_state(t, {}, frozenset())
    return None


def _init_from(t, source: Path, mode: str) -> dict:
    parts = LOAD_MODES[mode]
    if mode == "cooldown":
        check_stable_phase(source, t.cfg)
    state = t.checkpointer.load(source, t.model, t.optimizer, mode, t.cfg.model.name)
    try:
        take_trainer_state(t, state, parts)
    except ValueError as e:  # the data position of other data
        raise ValueError(f"checkpoint.load_mode = {mode!r} takes the data position of {source}: {e}") from e
    t.provenance = {"init_from": str(source), "load_mode": mode}
    t.after_load = watch_after_load(t, source)
    order = ("model", "optimizer", "schedule", "data", "step")
    log.info("initialised from %s with load_mode %s: took %s; fresh: %s; first step %d", source, mode,
             ", ".join(p for p in order if p in parts),
             ", ".join(p for p in order if p not in parts) or "nothing", t.step + 1)
    return load_event(t, source, mode)


def load_event(t, source, mode: str) -> dict:
    return {"event": "load", "step": t.step, "checkpoint": str(source), "mode": mode}


def watch_after_load(t, path: Path) -> AfterLoadWatch:
    t.checkpointer.hold_retention = t.cfg.checkpoint.verify != "full"
    return AfterLoadWatch(path, t.step, t.device, t.loss_group)


def take_trainer_state(t, state: dict, parts: frozenset[str]) -> None:
    """Step (and tokens seen), data position and schedule start from a checkpoint's trainer state where
    `parts` names them; otherwise the step is `checkpoint.step_offset`, the data fresh, and the schedule
    starts at the next step."""
    if "step" in parts:
        t.step, t.tokens_seen = state["step"], state.get("tokens_seen", 0)
    else:
        t.step, t.tokens_seen = t.cfg.checkpoint.step_offset, 0
    if "data" in parts:
        t.loader.load_state_dict(state["data"])
    if t.scaler is not None and "optimizer" in parts and "grad_scaler" in state:
        t.scaler.load_state_dict(state["grad_scaler"])
    t.schedule_start = state.get("schedule_start", 0) if "schedule" in parts else t.step
