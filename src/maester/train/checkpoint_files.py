"""What a checkpoint directory holds and how each of its files is read: the `step-<N>` names, the manifest
(every file's size and CRC-32) and its check, the trainer state, the RNG files, and DCP's reader that unpickles
only DCP's own metadata classes, so loading a checkpoint never runs code from it."""

from __future__ import annotations

import io
import json
import logging
import pickle
import random
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
    set_model_state_dict,
)

# Checkpoint names live where status reads them without torch; the names stay importable from here too.
from maester.train.checkpoint_dirs import STEP_DIR, TRAINER_STATE, is_complete, step_dirs


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


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model from a checkpoint (fine-tuning, generation); every model key must be present."""
    model_sd = get_model_state_dict(model)
    state = {"model": model_sd}
    dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))




