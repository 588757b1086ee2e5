"""Atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of `jobs/<name>/checkpoints/`:

    step-<N>/            a complete checkpoint: DCP files (.metadata, *.distcp) for model and optimizer,
                         trainer_state.json (step, schedule start, data position, tokens seen, and
                         `init_from`/`load_mode` where the run began from another checkpoint),
                         rng/rank<R>.pt, config.json, and manifest.json (every other file's size and CRC-32)
    latest -> step-<N>   a convenience link, moved (atomically) after step-<N> is complete
    step-<N>.tmp/        a save in progress; never loaded, removed by the next save
    step-<N>.damaged/    a checkpoint that failed its manifest check at resume, moved aside (never deleted)

A checkpoint is written under the temporary name, its manifest last, and renamed when every file is on disk, so a
crash at any moment leaves the previous checkpoint whole and loadable. A run resumes from the newest `step-<N>`
that matches its manifest, whatever `latest` says (copies made with `rsync -r` drop the link).
Checkpoint files are read without unpickling anything but DCP's own metadata classes (`SafeReader`).

A job resumes from its own latest checkpoint with everything in it; a new run can take named parts of
another checkpoint (`checkpoint.load_mode`, the table `LOAD_MODES`), or the weights of a Hugging Face model
directory (`checkpoint.init_from = "hf:PATH"`, `load_hf_weights`).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import warnings
import zlib
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
MANIFEST = "manifest.json"
DAMAGED = ".damaged"

# What DCP pickles into `.metadata`, and nothing else: loading a checkpoint must not run code from it.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of a checkpoint's metadata "
                                     f"(a crafted file: loading it could run code)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allowlist of DCP's metadata classes."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise ValueError(f"{path}: refused: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _safe_planner():
    """DCP's load planner, reading non-tensor values (the optimizer's hyperparameters) with `weights_only=True`;
    its own `load_bytes` unpickles them with `weights_only=False`."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise ValueError(f"the value of {fqn} is refused: it holds pickled objects beyond plain values and "
                                 f"tensors (loading it could run code)") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner()


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
    """A checkpoint directory from a checkpoint path, a `checkpoints/` directory or a job directory (its newest
    `step-<N>` that matches its manifest's sizes; damaged ones are skipped with a warning, not moved)."""
    path = Path(path)
    if path.is_dir() and (path / ".metadata").is_file():
        real = path.resolve()
        if not is_complete(real):
            raise ValueError(f"checkpoint {path} is incomplete (no {TRAINER_STATE} or .metadata)")
        return real
    for directory in (path, path / "checkpoints"):
        steps = step_dirs(directory)
        for step in steps:
            problems = verify_checkpoint(step, "size")
            if not problems:
                return step.resolve()
            log.warning("skipping the damaged checkpoint %s: %s", step, "; ".join(problems))
        if steps:
            raise ValueError(f"no intact checkpoint in {directory}: {', '.join(p.name for p in steps)} fail their "
                             f"manifest check (`maester checkpoint verify {directory}` lists why)")
    raise FileNotFoundError(f"no checkpoint at {path} (looked for a DCP checkpoint, and for step-N directories in it "
                            f"and in its checkpoints/)")


def step_dirs(directory: Path) -> list[Path]:
    """The `step-<N>` directories of a `checkpoints/` directory, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def crc32_of(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """Size and CRC-32 of each file `names` (relative to `root`), for a manifest."""
    return {name: {"size": (root / name).stat().st_size, "crc32": crc32_of(root / name)} for name in names}


def verify_checkpoint(path: Path, level: str = "size") -> list[str]:
    """What is wrong with checkpoint `path` against its manifest.json, one line per file; empty when it is intact.
    `level` "size" compares sizes, "full" also CRC-32s. A checkpoint from before manifests (none in it) is checked
    for its .metadata and trainer state only."""
    manifest_file = path / MANIFEST
    problems: list[str] = []
    if not manifest_file.is_file():
        problems = [f"{path / name}: missing" for name in (".metadata", TRAINER_STATE) if not (path / name).is_file()]
    else:
        try:
            files = json.loads(manifest_file.read_text())["files"]
            entries = [(name, int(e["size"]), str(e["crc32"])) for name, e in files.items()]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            return [f"{manifest_file}: not a manifest ({type(e).__name__}: {e})"]
        for name, size, crc in sorted(entries):
            file = path / name
            try:
                actual = file.stat().st_size
            except FileNotFoundError:
                problems.append(f"{file}: missing")
                continue
            if actual != size:
                problems.append(f"{file}: {actual} bytes, the manifest says {size}")
            elif level == "full" and (actual_crc := crc32_of(file)) != crc:
                problems.append(f"{file}: CRC-32 {actual_crc}, the manifest says {crc}")
    if not problems:
        try:
            read_trainer_state(path)
        except (ValueError, OSError) as e:
            problems.append(str(e).split(": the checkpoint is damaged")[0])
    return problems


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
        """The newest complete `step-<N>` (not verified: for reports; a resume uses `resume_point`)."""
        return next((p for p in step_dirs(self.dir) if is_complete(p)), None)

    def resume_point(self) -> tuple[Path | None, list[dict]]:
        """The checkpoint to resume from, as rank 0 finds it, on every rank (a collective): the newest `step-<N>`
        that passes its manifest check (`checkpoint.verify`). Newer damaged ones are moved aside to
        `step-<N>.damaged`; they come back as records ({checkpoint, moved_to, problems}) for the metrics. Ranks
        that each looked could disagree right after a requeue, where a shared filesystem caches per node."""
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self._find_resume_point()
        box: list = [None]
        if self.rank == 0:
            try:
                found, damaged = self._find_resume_point()
                box[0] = ("ok", None if found is None else str(found), damaged)
            except (ValueError, OSError) as e:
                box[0] = ("error", str(e), None)
        dist.broadcast_object_list(box, src=0)
        kind, value, damaged = box[0]
        if kind == "error":
            raise ValueError(value)
        return (None if value is None else Path(value)), damaged

    def _find_resume_point(self) -> tuple[Path | None, list[dict]]:
        link = self.dir / "latest"
        if link.is_dir() and not link.is_symlink():
            raise ValueError(f"{link} is a directory, not a link (a copy made with cp -a, cp -L or rsync -L): the "
                             f"step-N directories beside it are the checkpoints. Remove it, or rename it to the "
                             f"step-N its {TRAINER_STATE} names if that checkpoint is not beside it")
        self._check_writable()
        damaged = []
        for path in step_dirs(self.dir):
            problems = verify_checkpoint(path, self.cfg.verify)
            if not problems:
                if not (link.is_symlink() and os.readlink(link) == path.name):
                    log.warning("%s %s; resuming from the newest intact checkpoint %s and pointing the link at it",
                                link, f"points to {os.readlink(link)}" if link.is_symlink() else "is missing",
                                path.name)
                    self._point_latest_to(path)
                return path, damaged
            aside = self._move_aside(path)
            log.error("CHECKPOINT DAMAGED: %s fails its manifest check (%s); moved aside to %s", path,
                      "; ".join(problems), aside.name)
            damaged.append({"checkpoint": path.name, "moved_to": aside.name, "problems": problems})
        found = sorted(p.name for p in self.dir.glob(f"step-*{DAMAGED}*")) if self.dir.is_dir() else []
        if found:
            details = "".join(f"\n  {d['checkpoint']} (moved to {d['moved_to']}): {'; '.join(d['problems'])}"
                              for d in damaged)
            raise ValueError(f"no intact checkpoint in {self.dir}; found only damaged ones: {', '.join(found)}"
                             f"{details}\nTo start this job from step 0, move {self.dir} aside")
        if link.is_symlink():
            raise ValueError(f"{link} points to a missing checkpoint ({os.readlink(link)}) and no step-N directory "
                             f"is beside it")
        return None, damaged

    def _move_aside(self, path: Path) -> Path:
        aside, n = path.with_name(path.name + DAMAGED), 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}{DAMAGED}-{n}")
        os.replace(path, aside)
        _fsync_dir(self.dir)
        return aside

    def _check_writable(self) -> None:
        """Fail at start, not at the first save after hours of steps."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".write-test-{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"checkpoint directory {self.dir} cannot be written: {e.strerror or e}") from None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, trainer_state: dict,
             config_json: str) -> Path:
        """Write checkpoint `step` (a collective call: every rank writes its shards, then checksums its share of
        the files for the manifest), then move `latest` to it. An existing `step-<N>` is never overwritten.

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
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            with single_process_ok():
                dcp.save(state, checkpoint_id=tmp)  # a rank's failure is raised on every rank
        except (OSError, RuntimeError, CheckpointException) as e:
            raise self._not_written(final, tmp, e) from e
        maybe_crash("during_save", step)
        local_error = None
        try:
            (tmp / "rng").mkdir(exist_ok=True)
            rng = io.BytesIO()  # written with open(): a full disk is an OSError, not torch's zip writer's error
            torch.save(capture_rng_state(), rng)
            _write_durably(tmp / "rng" / f"rank{self.rank}.pt", rng.getvalue())
            if self.rank == 0:
                _write_durably(tmp / "config.json", config_json)
                _write_durably(tmp / TRAINER_STATE, json.dumps({"step": step, **trainer_state}, indent=2))
        except OSError as e:
            local_error = e
        _barrier()  # every rank's files are on disk before they are listed
        files, exists, error = self._describe_shares(tmp, final, local_error)
        if error is not None:
            raise self._not_written(final, tmp, error)
        if exists:
            raise ValueError(f"{final} already exists: a run never overwrites a checkpoint (is another run using "
                             f"{self.dir.parent}?)")
        if self.rank == 0:
            try:
                maybe_crash("before_manifest", step)
                _write_durably(tmp / MANIFEST, json.dumps({"step": step, "files": dict(sorted(files.items()))},
                                                          indent=1))
                os.replace(tmp, final)
                _fsync_dir(self.dir)
            except OSError as e:
                error = e
        error = _from_rank_zero(error)  # in place of a barrier: every rank learns whether the rename happened
        if error is not None:
            raise self._not_written(final, tmp, error)
        if self.rank == 0:
            maybe_crash("before_latest", step)
            self._point_latest_to(final)
            self._apply_retention(step)
        _barrier()
        return final

    def _not_written(self, final: Path, tmp: Path, error) -> ValueError:
        """The error of a save that failed (a full disk, a quota): the previous checkpoint is untouched. Rank 0
        removes the partial files, which would otherwise hold the space until the next save."""
        if isinstance(error, BaseException):
            # torch's zip writer turns a failed write into "unexpected pos": a probe write finds the reason
            error = (_failed_write(self.dir) if isinstance(error, RuntimeError) or "unexpected pos" in str(error)
                     else None) or _reason(error)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = self.latest()
        kept = f"{previous.name} is unchanged and is where a resume starts" if previous else "there is no earlier one"
        return ValueError(f"checkpoint {final.name} could not be written in {self.dir}: {error}. Nothing of it is "
                          f"kept; {kept}. Free space (or raise the quota) and run again")

    def _describe_shares(self, tmp: Path, final: Path, error: OSError | None) -> tuple[dict[str, dict], bool,
                                                                                      str | None]:
        """Every file of `tmp` with its size and CRC-32, each rank reading its share; whether `final` exists (rank
        0's view); and the first rank's write error (`error` is this rank's), on every rank."""
        import torch.distributed as dist

        names = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        reason = None if error is None else _reason(error)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return ({} if reason else describe_files(tmp, names)), final.exists(), reason
        world = dist.get_world_size()
        mine = ({} if reason else describe_files(tmp, names[self.rank::world]), self.rank == 0 and final.exists(),
                reason)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        files = {name: entry for part, _, _ in gathered for name, entry in part.items()}
        return files, gathered[0][1], next((r for _, _, r in gathered if r), None)

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
        metadata = SafeReader(path).read_metadata()
    return any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)


def _dcp_load(state: dict, path: Path) -> None:
    """`dcp.load` of checkpoint `path`; a missing or truncated file is an error that names it."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        SafeReader(path).read_metadata()  # a refused .metadata is reported alone, before DCP's own attempts
    except ValueError as e:
        raise ValueError(f"checkpoint {path} cannot be read: {e}") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"checkpoint {path} cannot be read: {path / '.metadata'}: "
                         f"{getattr(e, 'strerror', None) or 'a file ends early (truncated)'}") from None
    try:
        with single_process_ok():
            dcp.load(state, storage_reader=SafeReader(path), planner=_safe_planner())
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
        if any(m in reason for m in ("Size mismatch", "Missing key", "mismatch sizes")):
            raise ValueError(f"checkpoint {path} does not fit this run's model: {reason}. The checkpoint is not "
                             f"damaged: the model differs from the one that saved it (compare model.* with "
                             f"{path / 'config.json'})") from None
        raise ValueError(f"checkpoint {path} cannot be read: {where}: {reason}. It is damaged or incomplete "
                         f"(`maester checkpoint verify {path}` checks every file): move it aside to resume from an "
                         f"earlier one") from e


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
    from maester.models.hf import read_hf_config, read_hf_tensors, state_dict_from_hf, transformer_args_from_hf

    hf_name, hf_args = transformer_args_from_hf(read_hf_config(path), str(path / "config.json"))
    differing = hf_architecture_differences(name, model.args, hf_name, hf_args)
    if differing:
        raise ValueError(f"{where}: the run's model differs from {path / 'config.json'} in {'; '.join(differing)}: "
                         f"set model.hf_config = \"{path}\" to take the architecture from it")
    state = state_dict_from_hf(hf_name, hf_args, read_hf_tensors(path), where=str(path))
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    return {k: v.to(dtypes[k]) if k in dtypes else v for k, v in state.items()}


def _reason(error: BaseException) -> str:
    """What went wrong, from an OSError or DCP's CheckpointException (which holds each failing rank's error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        failure = next(iter(error.failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _failed_write(directory: Path) -> str | None:
    """The OSError of writing 4 MiB into `directory` (a full disk, a quota, a file size limit), or None."""
    probe = directory / f".write-probe-{os.getpid()}.tmp"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(4 << 20))
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as e:
        return e.strerror or str(e)
    finally:
        probe.unlink(missing_ok=True)


def _from_rank_zero(error: BaseException | None) -> str | None:
    """Rank 0's error (or None) on every rank; a barrier too."""
    import torch.distributed as dist

    reason = None if error is None else _reason(error)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return reason
    box = [reason]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _write_durably(path: Path, text: str | bytes) -> None:
    with open(path, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
