"""What a checkpoint directory holds and how each of its files is read: the `step-<N>` names, the manifest
(every file's size and checksum, `checkpoint_digests.py`) and its check, the trainer state, the RNG files, and
DCP's reader that unpickles only DCP's own metadata classes, so loading a checkpoint never runs code from it."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import stat
import warnings
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

# Checkpoint names live where status reads them without torch; the names stay importable from here too.
from maester.train.checkpoint_digests import DIGEST, MANIFEST_FORMAT, digest_of_bytes, file_digest
from maester.train.checkpoint_dirs import STEP_DIR, TRAINER_STATE, is_complete, step_dirs


log = logging.getLogger("maester")

# DCP warns at every save and load without a process group; one process is a supported layout, not a mistake.
# Filtered once here: a `warnings.catch_warnings()` around each call would swap the process-wide filter list from
# the background save's thread while the training thread runs.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")

MANIFEST = "manifest.json"
CHECKSUM_NAMES = {DIGEST: "XXH3-128", "crc32": "CRC-32"}


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


_METADATA_READ: dict[tuple, list] = {}
"""The last `.metadata` files read ([bytes, object or None]), by path and the file's identity: a resume's checks
and its load read the file once."""


def read_metadata(path: Path):
    """Checkpoint `path`'s DCP metadata, unpickled through an allowlist of DCP's metadata classes, every storage file
    it names confined to the checkpoint directory (a crafted `.metadata` must not read another checkpoint); read
    once while the file stays the same. A refused file is a ValueError; a missing one an OSError."""
    entry = _metadata_entry(path)
    if entry[1] is None:
        file = Path(path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(entry[0])).load()
        except pickle.UnpicklingError as e:
            raise ValueError(f"{file}: refused: {e}") from None
        for index, info in (getattr(metadata, "storage_data", None) or {}).items():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or not inside(name):
                raise ValueError(f"{file}: refused: the storage of {getattr(index, 'fqn', index)} is named "
                                 f"{name!r}, which is not a file inside the checkpoint directory (a crafted file)")
        entry[1] = metadata
    return entry[1]


def metadata_bytes(path: Path) -> bytes:
    """The bytes of checkpoint `path`'s `.metadata`, the ones `read_metadata` reads."""
    return _metadata_entry(path)[0]


def _metadata_entry(path: Path) -> list:
    file = Path(path) / ".metadata"
    st = os.stat(file)
    key = (str(file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _METADATA_READ:
        data = file.read_bytes()
        while len(_METADATA_READ) >= 4:
            _METADATA_READ.pop(next(iter(_METADATA_READ)))
        _METADATA_READ[key] = [data, None]
    return _METADATA_READ[key]


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` read by `read_metadata` (an allowlist of classes, storage files confined
    to the checkpoint directory, read once)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_planner():
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


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """Size and XXH3-128 of each file `names` (relative to `root`), as a manifest lists them."""
    return {name: {"size": (root / name).stat().st_size, DIGEST: file_digest(root / name, DIGEST)} for name in names}


def read_manifest(path: Path) -> list[tuple[str, int, str, str]]:
    """The entries (name, size, checksum kind, checksum) of checkpoint `path`'s manifest.json: format 2 lists
    XXH3-128s, an unversioned one (written before format 2) CRC-32s; a ValueError names what is wrong with it."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
        version = manifest.get("format", 1)
        if not isinstance(version, int) or version > MANIFEST_FORMAT:
            raise ValueError(f"format {version!r}, which this maester does not know (written by a newer one?)")
        kind = DIGEST if version >= 2 else "crc32"
        # an entry without its checksum passes a size check and fails a full one
        return sorted((str(name), int(e["size"]), kind, str(e.get(kind, ""))) for name, e in manifest["files"].items())
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not a manifest ({type(e).__name__}: {e})") from None


def verify_checkpoint(path: Path, level: str = "size", share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with checkpoint `path` against its manifest.json, one line per file; empty when it is intact.
    `level` "size" compares sizes, "full" also checksums. A manifest entry must name a regular file inside the
    checkpoint directory, and so must every storage file its `.metadata` names (`read_metadata`). A checkpoint
    whose trainer state has a `checkpoint_format` was written with a manifest, and is damaged without one; one from
    before manifests (none, and no format) is checked for its .metadata and trainer state only (`unverified`).

    `share` = (i, n): check only every n-th manifest entry from the i-th (n processes reading one checkpoint
    together, each its share; `n` results together cover it), the trainer state and .metadata in share 0."""
    index, count = share
    problems: list[str] = []
    if (path / MANIFEST).is_file():
        try:
            entries = read_manifest(path)
        except ValueError as e:
            return [str(e)] if index == 0 else []
        for name, size, kind, checksum in entries[index::count]:
            problem = _file_problem(path, name, size, kind, checksum if level == "full" else None)
            if problem:
                problems.append(problem)
    elif index == 0:
        problems = [f"{path / name}: missing" for name in (".metadata", TRAINER_STATE) if not (path / name).is_file()]
        entries = None
    if problems or index != 0:
        return problems
    try:
        state = read_trainer_state(path)
        if entries is None and state.get("checkpoint_format"):
            return [f"{path / MANIFEST}: missing, and {TRAINER_STATE} says the checkpoint was written with one "
                    f"(checkpoint_format {state['checkpoint_format']}): its files cannot be checked"]
        metadata = read_metadata(path)
        storage = {info.relative_path for info in (getattr(metadata, "storage_data", None) or {}).values()}
    except (ValueError, OSError, EOFError) as e:
        return [str(e).split(": the checkpoint is damaged")[0]]
    listed = {name for name, *_ in entries or ()}
    return [f"{path / name}: named by .metadata, " + ("not in the manifest" if entries is not None else "missing")
            for name in sorted(storage) if (name not in listed if entries is not None
                                            else not (path / name).is_file())]


def unverified(path: Path) -> bool:
    """Whether checkpoint `path` is from before manifests: its files' contents cannot be checked."""
    if (path / MANIFEST).is_file():
        return False
    try:
        return not read_trainer_state(path).get("checkpoint_format")
    except (ValueError, OSError):
        return False


def _file_problem(root: Path, name: str, size: int, kind: str, checksum: str | None) -> str | None:
    """What is wrong with the manifest entry `name` of checkpoint `root` (its size, and its checksum of `kind`
    unless `checksum` is None), or None."""
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
    if checksum is None:
        return None
    try:
        actual = file_digest(file, kind)
    except (OSError, ValueError) as e:
        return f"{file}: {getattr(e, 'strerror', None) or e}"
    return None if actual == checksum else checksum_problem(file, kind, actual, checksum)


def checksum_problem(file: Path, kind: str, actual: str, expected: str) -> str:
    return f"{file}: {CHECKSUM_NAMES[kind]} {actual}, the manifest says {expected}"


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
    metadata = read_metadata(path)
    return any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)


def checkpoint_family(path: Path) -> str | None:
    """The architecture (`model.name`) checkpoint `path` says it holds in its config.json; None when it says none."""
    try:
        name = json.loads((path / "config.json").read_text())["model"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def model_keys(model: nn.Module, state: dict | None = None) -> set[str]:
    """The names of the whole model's weights as checkpoints name them (under pipeline parallel, of every stage,
    not only this rank's); `state`: the model's state dict, where the caller has built it already."""
    whole = getattr(model, "whole_model", None)
    if whole is not None:
        return set(whole.state_dict())
    return set(state if state is not None else get_model_state_dict(model))


def match_model(path: Path, model: nn.Module, family: str | None, partial: bool = False,
                state: dict | None = None) -> set[str]:
    """The model weights to load from checkpoint `path`: every one of `model`'s. A checkpoint of another
    architecture (`family`, this run's `model.name`, against its config.json), or one holding weights the model has
    no place for or lacking some it needs, is refused naming both, unless `partial`: then the weights the two share
    by name are loaded (the rest of the model keeps its initialisation), and what is left out is logged. `state`:
    the model's state dict, where the caller has built it already."""
    metadata = read_metadata(path)
    saved = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    ours = model_keys(model, state)
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
