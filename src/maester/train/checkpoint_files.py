"""What a checkpoint directory holds and how each of its files is read: the `step-<N>` names, the manifest
(every file's size and CRC-32) and its check, the trainer state, the RNG files, and DCP's reader that unpickles
only DCP's own metadata classes, so loading a checkpoint never runs code from it."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import stat
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

# Checkpoint names live where status reads them without torch; the names stay importable from here too.
from maester.train.checkpoint_dirs import STEP_DIR, TRAINER_STATE, is_complete, step_dirs
from maester.train.checkpoint_tensors import plain_state


log = logging.getLogger("maester")





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


def inside(name: str) -> bool:
    """Whether a path that a checkpoint's own files name (a manifest entry, a DCP storage file) stays inside the
    checkpoint directory: relative, not empty, without `..` or a backslash."""
    path = PurePosixPath(name)
    return bool(path.parts) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allowlist of DCP's metadata classes, and every storage
    file it names confined to the checkpoint directory (a crafted `.metadata` must not read another checkpoint)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise ValueError(f"{path}: refused: {e}") from None
        for index, info in (getattr(metadata, "storage_data", None) or {}).items():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or not inside(name):
                raise ValueError(f"{path}: refused: the storage of {getattr(index, 'fqn', index)} is named "
                                 f"{name!r}, which is not a file inside the checkpoint directory (a crafted file)")
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


def crc32_of(path: Path) -> str:
    """The CRC-32 of a regular file (opened without blocking, so that a FIFO put in its place cannot hang the read;
    anything but a regular file is a ValueError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        crc = 0
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """Size and CRC-32 of each file `names` (relative to `root`), for a manifest."""
    return {name: {"size": (root / name).stat().st_size, "crc32": crc32_of(root / name)} for name in names}


def verify_checkpoint(path: Path, level: str = "size", share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with checkpoint `path` against its manifest.json, one line per file; empty when it is intact.
    `level` "size" compares sizes, "full" also CRC-32s. A manifest entry must name a regular file inside the
    checkpoint directory. A checkpoint from before manifests (none in it) is checked for its .metadata and trainer
    state only.

    `share` = (i, n): check only every n-th manifest entry from the i-th (n processes reading one checkpoint
    together, each its share; `n` results together cover it), the trainer state in share 0."""
    index, count = share
    manifest_file = path / MANIFEST
    problems: list[str] = []
    if not manifest_file.is_file():
        if index == 0:
            problems = [f"{path / name}: missing" for name in (".metadata", TRAINER_STATE)
                        if not (path / name).is_file()]
    else:
        try:
            files = json.loads(manifest_file.read_text())["files"]
            entries = [(str(name), int(e["size"]), str(e["crc32"])) for name, e in files.items()]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            return [f"{manifest_file}: not a manifest ({type(e).__name__}: {e})"] if index == 0 else []
        for name, size, crc in sorted(entries)[index::count]:
            problem = _file_problem(path, name, size, crc if level == "full" else None)
            if problem:
                problems.append(problem)
    if not problems and index == 0:
        try:
            read_trainer_state(path)
        except (ValueError, OSError) as e:
            problems.append(str(e).split(": the checkpoint is damaged")[0])
    return problems


def _file_problem(root: Path, name: str, size: int, crc: str | None) -> str | None:
    """What is wrong with the manifest entry `name` of checkpoint `root` (its size, and its CRC-32 unless `crc` is
    None), or None."""
    if not inside(name):
        return f"{root}: the manifest names {name!r}, which is not a file inside the checkpoint directory"
    file = root / name
    try:
        st = file.stat()
    except FileNotFoundError:
        return f"{file}: missing"
    except OSError as e:
        return f"{file}: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{file}: not a regular file"
    if st.st_size != size:
        return f"{file}: {st.st_size} bytes, the manifest says {size}"
    if crc is None:
        return None
    try:
        actual = crc32_of(file)
    except (OSError, ValueError) as e:
        return f"{file}: {getattr(e, 'strerror', None) or e}"
    return None if actual == crc else f"{file}: CRC-32 {actual}, the manifest says {crc}"


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


def dcp_load(state: dict, path: Path) -> None:
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


def checkpoint_family(path: Path) -> str | None:
    """The architecture (`model.name`) checkpoint `path` says it holds in its config.json; None when it says none."""
    try:
        name = json.loads((path / "config.json").read_text())["model"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def model_keys(model: nn.Module) -> set[str]:
    """The names of the whole model's weights as checkpoints name them (under pipeline parallel, of every stage,
    not only this rank's)."""
    whole = getattr(model, "whole_model", None)
    return set(whole.state_dict()) if whole is not None else set(get_model_state_dict(model))


def match_model(path: Path, model: nn.Module, family: str | None, partial: bool = False) -> set[str]:
    """The model weights to load from checkpoint `path`: every one of `model`'s. A checkpoint of another
    architecture (`family`, this run's `model.name`, against its config.json), or one holding weights the model has
    no place for or lacking some it needs, is refused naming both, unless `partial`: then the weights the two share
    by name are loaded (the rest of the model keeps its initialisation), and what is left out is logged."""
    with single_process_ok():
        metadata = SafeReader(path).read_metadata()
    saved = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    ours = model_keys(model)
    theirs = checkpoint_family(path)
    extra, missing = sorted(saved - ours), sorted(ours - saved)

    def some(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (f", ... ({len(keys)} in all)" if len(keys) > 3 else "")

    if partial:
        if not saved & ours:
            raise ValueError(f"checkpoint {path} shares no weight name with this model: nothing to load")
        if extra or missing or theirs != family:
            log.warning("partial load of %s (%s) into %s: ignoring %d checkpoint weight(s)%s; %d weight(s) keep their "
                        "initialisation%s", path, theirs or "architecture unknown", family, len(extra),
                        f" ({some(extra)})" if extra else "", len(missing), f" ({some(missing)})" if missing else "")
        return saved & ours
    fix = (f"compare model.* with {path / 'config.json'}; checkpoint.load_mode = 'model_partial' takes the weights "
           f"the two share by name")
    if family is not None and theirs is not None and theirs != family:
        raise ValueError(f"checkpoint {path} holds a {theirs} model, and this run's model is {family}: it does not fit "
                         f"this run's model ({fix})")
    if extra:
        raise ValueError(f"checkpoint {path} does not fit this run's model: it holds weights this "
                         f"{family or 'model'} has no place for ({some(extra)}), so it was saved from another "
                         f"architecture{' than its config.json says' if theirs == family else ''} ({fix})")
    if missing:
        raise ValueError(f"checkpoint {path} does not fit this run's model: it lacks weights the model needs "
                         f"({some(missing)}) ({fix})")
    return ours


def load_model_weights(path: Path, model: nn.Module, family: str | None = None, partial: bool = False) -> None:
    """Load only the model from a checkpoint (fine-tuning, generation): every model key must be present and none
    other (`match_model`; `partial`: the keys the two share)."""
    keys = match_model(path, model, family, partial)
    state = {"model": plain_state({k: v for k, v in get_model_state_dict(model).items() if k in keys})}
    dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not partial))
