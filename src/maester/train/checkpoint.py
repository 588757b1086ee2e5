"""Atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of `jobs/<name>/checkpoints/`:

    step-<N>/            a complete checkpoint: DCP files (.metadata, *.distcp) for model and optimizer,
                         trainer_state.json (step, schedule start, data position, tokens seen, and
                         `init_from`/`load_mode` where the run began from another checkpoint),
                         rng/rank<R>.pt, config.json
    latest -> step-<N>   moved (atomically) only after step-<N> is complete
    step-<N>.tmp/        a save in progress; never loaded, removed by the next save

A checkpoint is written under the temporary name and renamed when every file is on disk, so a crash at any
moment leaves the previous checkpoint as `latest`, whole and loadable.

A job resumes from its own latest checkpoint with everything in it; a new run can take named parts of
another checkpoint (`checkpoint.load_mode`, the table `LOAD_MODES`), or the weights of a Hugging Face model
directory (`checkpoint.init_from = "hf:PATH"`, `load_hf_weights`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from maester.config import LOAD_MODES, CheckpointConfig
from maester.train.faults import maybe_crash

log = logging.getLogger("maester")

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"


@contextmanager
def single_process_ok():
    """DCP warns when no process group exists; one process is a supported layout, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def is_complete(path: Path) -> bool:
    """A finished checkpoint: not a save (or deletion) in progress, which carries a `.tmp` name, and with its DCP
    metadata and trainer state. A job names its checkpoints step-<N>; a converted one may have any name."""
    return not path.name.endswith(".tmp") and (path / ".metadata").is_file() and (path / TRAINER_STATE).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path, a `checkpoints/` directory or a job directory."""
    path = Path(path)
    for candidate in (path, path / "latest", path / "checkpoints" / "latest"):
        if candidate.is_dir() and (candidate / ".metadata").is_file():
            real = candidate.resolve()
            if not is_complete(real):
                raise ValueError(f"checkpoint {candidate} is incomplete (no {TRAINER_STATE} or .metadata)")
            return real
    raise FileNotFoundError(f"no checkpoint at {path} (looked for a DCP checkpoint, latest, checkpoints/latest)")


def capture_rng_state() -> dict:
    """Python's, NumPy's, torch's and CUDA's generator states as tensors and plain values only, so that
    `torch.load(..., weights_only=True)` reads them back: loading a checkpoint never runs code."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    if isinstance(py, dict):
        random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
        np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                             npy["cached_gaussian"]))
    else:  # an older checkpoint's pickled tuples (read only with checkpoint.trust_pickled_rng)
        random.setstate(py)
        np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_rng_state(path: Path, trust_pickle: bool = False) -> dict:
    """An RNG state file, read with `weights_only=True`. A file from before this format holds pickled Python
    objects; it is read only when `trust_pickle` (`checkpoint.trust_pickled_rng`) says its source is trusted."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if not trust_pickle:
            raise ValueError(f"{path}: the RNG state holds pickled objects (a checkpoint from an older maester, or "
                             f"a crafted file): loading it could run code, so it is refused. If you trust this "
                             f"checkpoint, set checkpoint.trust_pickled_rng = true") from e
    log.warning("%s: loading a pickled RNG state because checkpoint.trust_pickled_rng = true; the next checkpoint "
                "is saved without pickle", path)
    return torch.load(path, weights_only=False)


class Checkpointer:
    def __init__(self, job_dir: Path, cfg: CheckpointConfig, rank: int = 0):
        self.dir = Path(job_dir) / "checkpoints"
        self.cfg, self.rank = cfg, rank

    def latest(self) -> Path | None:
        link = self.dir / "latest"
        if not link.exists():
            if link.is_symlink():
                raise ValueError(f"{link} points to a missing checkpoint ({os.readlink(link)})")
            return None
        return resolve_checkpoint(link)

    def latest_agreed(self) -> Path | None:
        """`latest` as rank 0 resolves it, on every rank (a collective). Ranks that each read the link can
        disagree right after a requeue, where a shared filesystem caches attributes per node."""
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.latest()
        box: list = [None]
        if self.rank == 0:
            try:
                latest = self.latest()
                box[0] = ("ok", None if latest is None else str(latest))
            except ValueError as e:
                box[0] = ("error", str(e))
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise ValueError(value)
        return None if value is None else Path(value)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, trainer_state: dict,
             config_json: str) -> Path:
        """Write checkpoint `step` (a collective call: every rank writes its shards), then move `latest` to it.

        Without an optimizer only the model is written (a seed checkpoint).
        """
        final = self.dir / f"step-{step}"
        tmp = self.dir / f"step-{step}.tmp"
        if self.rank == 0:
            self._remove_unfinished()
            self.dir.mkdir(parents=True, exist_ok=True)
        _barrier()
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        with single_process_ok():
            dcp.save(state, checkpoint_id=tmp)
        maybe_crash("during_save", step)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(capture_rng_state(), tmp / "rng" / f"rank{self.rank}.pt")
        _barrier()  # every rank's files are on disk before the rename makes the checkpoint visible
        if self.rank == 0:
            _write_durably(tmp / "config.json", config_json)
            _write_durably(tmp / TRAINER_STATE, json.dumps({"step": step, **trainer_state}, indent=2))
            if final.exists():  # a checkpoint of this step from an earlier, superseded attempt
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            self._point_latest_to(final)
            self._apply_retention(step)
        _barrier()
        return final

    def _point_latest_to(self, target: Path) -> None:
        tmp_link = self.dir / "latest.tmp"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(target.name, tmp_link)
        os.replace(tmp_link, self.dir / "latest")
        _fsync_dir(self.dir)

    def _remove_unfinished(self) -> None:
        if self.dir.is_dir():
            for path in self.dir.glob("*.tmp"):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()

    def _apply_retention(self, newest: int) -> None:
        steps = sorted(int(STEP_DIR.match(p.name)[1]) for p in self.dir.iterdir() if STEP_DIR.match(p.name))
        keep = set(steps[-self.cfg.keep_last:]) | {newest}
        if self.cfg.keep_every:
            keep |= {s for s in steps if s % self.cfg.keep_every == 0}
        for s in steps:
            if s not in keep:
                doomed = self.dir / f"step-{s}"
                trash = self.dir / f"step-{s}.deleting.tmp"
                os.replace(doomed, trash)  # no half-deleted directory ever carries a step-<N> name
                shutil.rmtree(trash)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mode: str = "continue") -> dict:
        """Restore the parts of checkpoint `path` that load mode `mode` takes (`LOAD_MODES`) into `model` and
        `optimizer`, resharded to their current layout; returns the trainer state (step, data position, ...) for
        the caller to take the rest from. `continue` also restores this rank's RNG state.

        The optimizer keeps the config's hyperparameters (betas, weight decay, ...); only its state (moments,
        step counts) is taken. A part the mode needs but the checkpoint lacks is an error.
        """
        parts = LOAD_MODES[mode]
        trainer_state = read_trainer_state(path)
        if "optimizer" in parts and not has_optimizer_state(path):
            raise ValueError(f"load mode {mode!r} takes the optimizer state, but checkpoint {path} has none (a seed "
                             f"or converted checkpoint); take the model only (load_mode 'model_only' or "
                             f"'model_data')")
        if "data" in parts and "data" not in trainer_state:
            raise ValueError(f"load mode {mode!r} takes the data position, but checkpoint {path} has none (a seed "
                             f"or converted checkpoint); use a mode that starts the data fresh")
        if "optimizer" not in parts:
            load_model_weights(path, model)
            return trainer_state
        model_sd, optim_sd = get_state_dict(model, optimizer)
        hyperparameters = copy.deepcopy(optim_sd["param_groups"])
        state = {"model": model_sd, "optimizer": optim_sd}
        _dcp_load(state, path)
        state["optimizer"]["param_groups"] = hyperparameters
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if mode != "continue":
            return trainer_state
        rng_file = path / "rng" / f"rank{self.rank}.pt"
        if rng_file.is_file():
            restore_rng_state(read_rng_state(rng_file, self.cfg.trust_pickled_rng))
        else:
            log.warning("checkpoint %s has no RNG state for rank %d (saved on fewer ranks)", path, self.rank)
        return trainer_state


def read_trainer_state(path: Path) -> dict:
    """The step, data position and provenance of checkpoint `path` (its trainer_state.json); a damaged file is an
    error that names it."""
    file = path / TRAINER_STATE
    try:
        state = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}): the checkpoint is damaged; move it aside to resume from "
                         f"an earlier one") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{file}: no integer 'step' in it: the checkpoint is damaged; move it aside to resume "
                         f"from an earlier one")
    return state


def has_optimizer_state(path: Path) -> bool:
    """Whether checkpoint `path` holds optimizer state (a seed or converted checkpoint holds the model only)."""
    with single_process_ok():
        metadata = dcp.FileSystemReader(path).read_metadata()
    return any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)


def _dcp_load(state: dict, path: Path) -> None:
    """`dcp.load` of checkpoint `path`; a missing or truncated file is an error that names it."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with single_process_ok():
            dcp.load(state, checkpoint_id=path)
    except (OSError, EOFError, pickle.UnpicklingError, CheckpointException) as e:
        cause = e
        if isinstance(e, CheckpointException) and e.failures:  # the first failing rank's own error
            failure = next(iter(e.failures.values()))
            cause = failure[0] if isinstance(failure, tuple) else failure
        where = getattr(cause, "filename", None) or path
        if isinstance(cause, EOFError):
            reason = "a file ends early (truncated)"
        elif isinstance(cause, OSError) and cause.strerror:
            reason = cause.strerror
        else:
            reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise ValueError(f"checkpoint {path} cannot be read: {where}: {reason}. It is damaged or incomplete: move it "
                         f"aside and point {path.parent / 'latest'} at an earlier checkpoint to resume from there") \
            from e


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model from a checkpoint (fine-tuning, generation); every model key must be present."""
    model_sd = get_model_state_dict(model)
    state = {"model": model_sd}
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


# Fields an `hf:` source may differ in from the run's model: the attention kernel, the init of weights that are
# loaded anyway, and the context length the run trains at.
_HF_FREE_FIELDS = ("attention", "init_std", "max_seq_len")


def hf_architecture_differences(name: str, args, hf_name: str, hf_args) -> list[str]:
    """How the run's model (architecture `name`, `args`) differs from an HF directory's; empty when its weights
    fit. The head dimension is compared resolved; the vocabulary must be the same size."""
    out = [] if name == hf_name else [f"architecture (run {name}, HF {hf_name})"]
    return out + [f"{key} (run {ours!r}, HF {theirs!r})"
                  for key, (ours, theirs) in args.differences(hf_args, ignore=_HF_FREE_FIELDS).items()]


def load_hf_weights(path: Path, model: nn.Module, name: str, where: str) -> None:
    """Load the weights of the HF model directory `path` into `model` (architecture `name`), which may be sharded
    (FSDP, TP). With several processes only rank 0 reads the directory; the tensors are broadcast and each rank keeps
    its shards, and rank 0's error is raised on every rank. The directory's config.json must describe `model.args`
    (`hf_architecture_differences`); `where` names the setting that asked, for the error."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    if not distributed:
        set_model_state_dict(model, _read_hf_state(path, model, name, where),
                             options=StateDictOptions(full_state_dict=True, strict=True))
        return
    state, error = {}, None
    if torch.distributed.get_rank() == 0:
        try:
            state = _read_hf_state(path, model, name, where)
        except Exception as e:  # raised below, after every rank has heard of it
            error = e
    outcome = [None if error is None else f"{type(error).__name__}: {error}"]
    torch.distributed.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise RuntimeError(f"{where}: rank 0 could not load {path}: {outcome[0]}")
    set_model_state_dict(model, state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True))


def _read_hf_state(path: Path, model: nn.Module, name: str, where: str) -> dict[str, torch.Tensor]:
    """The full state dict of `model` from the HF directory `path`, in the model's dtypes."""
    from maester.models.args import TransformerArgs
    from maester.models.hf import args_from_hf, read_hf_config, read_hf_tensors, state_dict_from_hf

    hf_name, fields = args_from_hf(read_hf_config(path), str(path / "config.json"))
    hf_args = TransformerArgs(**fields)
    differing = hf_architecture_differences(name, model.args, hf_name, hf_args)
    if differing:
        raise ValueError(f"{where}: the run's model differs from {path / 'config.json'} in {'; '.join(differing)}: "
                         f"set model.hf_config = \"{path}\" to take the architecture from it")
    state = state_dict_from_hf(hf_name, hf_args, read_hf_tensors(path), where=str(path))
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    return {k: v.to(dtypes[k]) if k in dtypes else v for k, v in state.items()}


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
