"""Loading a checkpoint in one pass over its bytes: each DCP file is mapped, each tensor copied from the mapping
straight into its (sharded) destination, and the file's checksum computed from the same pages in a second thread
while the copies run, so a full verification reads nothing twice.

DCP's own reader (`FileSystemReader.read_data`) runs `torch.load` on every record, which copies the bytes into a new
tensor before they are copied into the destination. A record DCP writes is a `torch.save` zip of one tensor: its
central directory gives where the storage's bytes lie, and its `data.pkl` (read through an allowlist that knows one
function, `_rebuild_tensor_v2`, and the storage classes) their dtype, shape and strides. A record that is anything
else (another rebuild function, a compressed or transformed record) goes through `torch.load(weights_only=True)`,
as DCP's reader does it.

Verification is shared out by the coordinator of DCP's load plan (`prepare_global_plan`): each file of the manifest
is checked by one rank, the rank that reads it (the least loaded where several read it, for a resharded load); the
small shared files (`.metadata`, the trainer state, the config, the RNG files) by rank 0, and a file nobody reads by
the least loaded rank. A rank's cost is then its share of the checkpoint, however many ranks load it."""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn
from torch.futures import Future
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from maester.train.checkpoint_digests import DIGEST, checksum_of_buffer, digest_of_bytes, file_digest, mapped
from maester.train.checkpoint_files import (
    SafeReader, checksum_problem, match_model, metadata_bytes, read_metadata, safe_planner,
)
from maester.train.checkpoint_tensors import plain_state


class DamagedCheckpoint(ValueError):
    """Files of a checkpoint that differ from its manifest, found while loading it (one line per file)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)

    def __reduce__(self):  # DCP sends a rank's error to the others pickled
        return DamagedCheckpoint, (self.problems,)


_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maester-checkpoint-hash")


class OnePassReader(SafeReader):
    """`SafeReader` that loads every tensor record without an intermediate copy and, given `expected` (the
    manifest's entries by name: size, checksum kind, checksum), checks this rank's share of the files in the same
    pass; a difference is a `DamagedCheckpoint` raised on every rank, after the reads."""

    def __init__(self, path: Path, expected: dict[str, tuple[int, str, str]] | None = None):
        super().__init__(path)
        self.expected = expected

    def prepare_global_plan(self, plans: list) -> list:
        if self.expected is None:
            return plans
        readers = collections.defaultdict(set)
        for rank, plan in enumerate(plans):
            for item in plan.items:
                readers[self.storage_data[item.storage_index].relative_path].add(rank)
        load, duty = [0] * len(plans), [[] for _ in plans]
        for name, (size, _, _) in sorted(self.expected.items(), key=lambda e: (-e[1][0], e[0])):
            if name == ".metadata":  # every rank checks it before unpickling it (`dcp_load`)
                continue
            if name in readers:
                rank = min(readers[name], key=lambda r: (load[r], r))
            elif name.endswith(".distcp"):
                rank = min(range(len(plans)), key=lambda r: (load[r], r))
            else:
                rank = 0
            duty[rank].append(name)
            load[rank] += size
        return [dataclasses.replace(plan, storage_data=names) for plan, names in zip(plans, duty)]

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = collections.defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        duty = set(plan.storage_data or ()) if self.expected is not None else set()
        problems: list[str] = []
        for name in sorted(set(per_file) | {n for n in duty if n.endswith(".distcp")}):
            problems += self._read_file(name, per_file.get(name, []), planner, name in duty)
        for name in sorted(n for n in duty if n not in per_file and not n.endswith(".distcp")):
            problems += self._check_small_file(name)
        if problems:
            raise DamagedCheckpoint(problems)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list, planner, verify: bool) -> list[str]:
        """Load `items` from file `name`, and check it against the manifest if `verify`; its problems."""
        file = Path(self.path) / name
        size, kind, _ = self.expected[name] if verify else (None, DIGEST, None)
        with mapped(file, private=True) as buffer:
            found = len(buffer)
            if verify and found != size:
                return _problems(file, found, None, self.expected[name])
            ends = [self.storage_data[i.storage_index].offset + self.storage_data[i.storage_index].length
                    for i in items]
            if max(ends, default=0) > len(buffer):
                raise ValueError(f"{file}: a file ends early (truncated)")
            hashing = _HASHER.submit(checksum_of_buffer, buffer, kind) if verify else None
            try:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._load_item(buffer, item, planner)
            finally:
                actual = hashing.result() if hashing is not None else None
        return _problems(file, found, actual, self.expected[name]) if verify else []

    def _check_small_file(self, name: str) -> list[str]:
        file = Path(self.path) / name
        try:
            found, actual = file.stat().st_size, file_digest(file, self.expected[name][1])
        except (OSError, ValueError) as e:
            return [f"{file}: {getattr(e, 'strerror', None) or e}"]
        return _problems(file, found, actual, self.expected[name])

    def _load_item(self, buffer, item, planner) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        info = self.storage_data[item.storage_index]
        record = memoryview(buffer)[info.offset:info.offset + info.length]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(record)))
            return
        target = planner.resolve_tensor(item).detach()
        source = None if info.transform_descriptors else _tensor_in_record(buffer, info.offset, info.length)
        if source is None:
            source = torch.load(io.BytesIO(bytes(record)), map_location="cpu", weights_only=True)
        source = narrow_tensor_by_index(source, item.storage_offsets, item.lengths)
        if target.size() != source.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {source.size()}")
        if target.dtype == source.dtype and target.is_contiguous() and source.is_contiguous() and source.numel():
            # bytes to bytes: no alignment needed, one copy from the page cache into the destination
            target.view(-1).view(torch.uint8).copy_(source.view(-1).view(torch.uint8))
        else:
            target.copy_(source if source.data_ptr() % source.element_size() == 0 else source.clone())
        planner.commit_tensor(item, target)


def _problems(file: Path, size: int, actual: str, expected: tuple[int, str, str]) -> list[str]:
    """How file `file` of `size` bytes with checksum `actual` differs from its manifest entry `expected`."""
    if size != expected[0]:
        return [f"{file}: {size} bytes, the manifest says {expected[0]}"]
    return [] if actual == expected[2] else [checksum_problem(file, expected[1], actual, expected[2])]


def check_metadata(path: Path, expected: dict[str, tuple[int, str, str]] | None) -> None:
    """Raise `DamagedCheckpoint` where `path`'s .metadata differs from its manifest entry, checked on the bytes
    that are then unpickled (by every rank: each reads the file anyway)."""
    if not expected or ".metadata" not in expected:
        return
    try:
        data = metadata_bytes(path)
    except OSError as e:
        raise DamagedCheckpoint([f"{path / '.metadata'}: {e.strerror}"]) from None
    kind = expected[".metadata"][1]
    actual = digest_of_bytes(data) if kind == DIGEST else checksum_of_buffer(data, kind)
    problems = _problems(path / ".metadata", len(data), actual, expected[".metadata"])
    if problems:
        raise DamagedCheckpoint(problems)


def _rebuild(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return storage, storage_offset, tuple(size), tuple(stride)


_STORAGE_DTYPES = torch.storage._storage_type_to_dtype_map()  # e.g. "FloatStorage": torch.float32


class _RecordUnpickler(pickle.Unpickler):
    """`data.pkl` of a record holding one plain tensor: (storage (dtype, key, numel), offset, size, stride)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(str(pid))
        return dtype, str(key), int(numel)


def _tensor_in_record(buffer, offset: int, length: int) -> torch.Tensor | None:
    """The tensor of the `torch.save` record at `offset` of `buffer`, as a view of the buffer's bytes; None where the
    record is not one uncompressed little-endian plain tensor."""
    members = _zip_members(buffer, offset, length)
    if members is None:
        return None
    pkl = next((n for n in members if n.endswith("/data.pkl")), None)
    order = next((n for n in members if n.endswith("/byteorder")), None)
    if pkl is None or (order is not None and _member(buffer, members[order]) != b"little"):
        return None
    try:
        (dtype, key, numel), storage_offset, size, stride = _RecordUnpickler(
            io.BytesIO(_member(buffer, members[pkl]))).load()
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError):
        return None
    name = next((n for n in members if n.endswith(f"/data/{key}")), None)
    if name is None or members[name][1] != numel * dtype.itemsize or numel == 0:
        return None
    start, nbytes = members[name]
    try:
        storage = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start)
        return storage.view(dtype).as_strided(size, stride, storage_offset)
    except RuntimeError:
        return None


def _member(buffer, where: tuple[int, int]) -> bytes:
    return bytes(buffer[where[0]:where[0] + where[1]])


def _zip_members(buffer, offset: int, length: int) -> dict[str, tuple[int, int]] | None:
    """The stored (uncompressed) members of the zip at `offset` of `buffer`, by name: (absolute offset, size) of
    their data, from the central directory (torch's writer puts the sizes there, not in the local headers)."""
    end = offset + length
    if length < 22 or buffer[end - 22:end - 18] != b"PK\x05\x06":
        return None
    count, _, directory = struct.unpack_from("<HII", buffer, end - 12)
    locator = end - 22 - 20
    if locator >= offset and buffer[locator:locator + 4] == b"PK\x06\x07":  # zip64: the sizes may not fit 32 bits
        (at,) = struct.unpack_from("<Q", buffer, locator + 8)
        if buffer[offset + at:offset + at + 4] != b"PK\x06\x06":
            return None
        count, _, directory = struct.unpack_from("<QQQ", buffer, offset + at + 32)
    members, p = {}, offset + directory
    for _ in range(count):
        if p + 46 > end or buffer[p:p + 4] != b"PK\x01\x02":
            return None
        (method, csize, usize, nlen, xlen, clen, header) = struct.unpack_from("<10xH8xIIHHH8xI", buffer, p)
        name = bytes(buffer[p + 46:p + 46 + nlen]).decode("utf-8", "replace")
        csize, header = _zip64_sizes(buffer, p + 46 + nlen, xlen, usize, csize, header)
        if method != 0 or offset + header + 30 > end:
            return None
        nlen2, xlen2 = struct.unpack_from("<HH", buffer, offset + header + 26)
        data = offset + header + 30 + nlen2 + xlen2
        if data + csize > end:
            return None
        members[name] = (data, csize)
        p += 46 + nlen + xlen + clen
    return members


def _zip64_sizes(buffer, extra: int, xlen: int, usize: int, csize: int, header: int) -> tuple[int, int]:
    """(compressed size, local header offset), from the zip64 extra field where the 32-bit fields overflowed."""
    p = extra
    while p + 4 <= extra + xlen:
        tag, size = struct.unpack_from("<HH", buffer, p)
        if tag == 1:
            q = p + 4
            if usize == 0xFFFFFFFF:
                q += 8
            if csize == 0xFFFFFFFF:
                (csize,) = struct.unpack_from("<Q", buffer, q)
                q += 8
            if header == 0xFFFFFFFF:
                (header,) = struct.unpack_from("<Q", buffer, q)
            break
        p += 4 + size
    return csize, header


def dcp_load(state: dict, path: Path, expected: dict[str, tuple[int, str, str]] | None = None) -> None:
    """`dcp.load` of checkpoint `path` through `OnePassReader` (`expected`: the manifest's entries to check in the
    same pass, a difference raised as `DamagedCheckpoint`); a missing or truncated file is an error that names
    it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_metadata(path, expected)
    try:
        read_metadata(path)  # a refused .metadata is reported alone, before DCP's own attempts
    except ValueError as e:
        raise ValueError(f"checkpoint {path} cannot be read: {e}") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"checkpoint {path} cannot be read: {path / '.metadata'}: "
                         f"{getattr(e, 'strerror', None) or 'a file ends early (truncated)'}") from None
    try:
        dcp.load(state, storage_reader=OnePassReader(path, expected), planner=safe_planner())
    except (OSError, EOFError, pickle.UnpicklingError, CheckpointException, DamagedCheckpoint) as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()] if isinstance(
            e, CheckpointException) and e.failures else [e]
        damaged = [problem for c in causes if isinstance(c, DamagedCheckpoint) for problem in c.problems]
        if damaged:
            raise DamagedCheckpoint(damaged) from None
        cause = causes[0]  # the first failing rank's own error
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


def load_model_weights(path: Path, model: nn.Module, family: str | None = None, partial: bool = False,
                       expected: dict[str, tuple[int, str, str]] | None = None) -> None:
    """Load only the model from a checkpoint (fine-tuning, generation): every model key must be present and none
    other (`match_model`; `partial`: the keys the two share); `expected` as for `dcp_load`."""
    state = get_model_state_dict(model)
    keys = match_model(path, model, family, partial, state)
    # read into the live tensors' storage (plain_state unwraps float8 weights without a copy)
    state = {"model": plain_state({k: v for k, v in state.items() if k in keys})}
    dcp_load(state, path, expected)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not partial))
