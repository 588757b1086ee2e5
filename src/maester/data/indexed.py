"""Pre-tokenized corpora on disk: Megatron / GPT-NeoX indexed datasets (`.bin` + `.idx`), llm.c shards, nanoGPT bins.

The `MMIDIDX` index (version 1) is read and written byte for byte as Megatron-LM and GPT-NeoX do:

    magic b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q N sequences | <Q D doc_idx entries
    | <i4 sizes[N] | <i8 byte pointers[N] | <i8 doc_idx[D]

The `.bin` is the headerless little-endian concatenation of every sequence's tokens. Float dtype codes (6, 7)
mean different things in the two projects and are refused. Writers build both files under temporary names and
rename them into place only when complete, so a crash never leaves a half-written pair under the final names.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from maester.files import AtomicOutputs

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N sequences, D doc_idx entries
HEADER_SIZE = HEADER.size  # 34

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
    4: np.dtype(np.int32), 5: np.dtype(np.int64), 8: np.dtype(np.uint16),
}
_CODE_OF = {dt.type: code for code, dt in DTYPE_CODES.items()}
_FLOAT_CODES = {6: "float32 in GPT-NeoX but float64 in Megatron-LM",
                7: "float64 in GPT-NeoX but float32 in Megatron-LM"}

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4

PathLike = str | os.PathLike


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron-LM and GPT-NeoX pick: uint16 when vocab_size < 65500, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype) -> int:
    """The index's code for a token dtype; float and unknown dtypes are refused."""
    dt = np.dtype(dtype)
    if dt.type not in _CODE_OF:
        raise ValueError(f"dtype {dt} cannot be stored in an indexed dataset; use one of "
                         f"{', '.join(str(d) for d in DTYPE_CODES.values())} (float codes are ambiguous)")
    return _CODE_OF[dt.type]


def _dtype_of_code(code: int, path: Path) -> np.dtype:
    if code in _FLOAT_CODES:
        raise ValueError(f"{path}: dtype code {code} means {_FLOAT_CODES[code]}; float token files are refused")
    if code not in DTYPE_CODES:
        raise ValueError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    return DTYPE_CODES[code]


def _le(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _paths(prefix: PathLike) -> tuple[Path, Path]:
    p = os.fspath(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


# --- atomic writes ---------------------------------------------------------------------------------------------

def _write_index(path: Path, dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{path}: sequence sizes must lie in [0, 2**31 - 1]")
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(sizes), len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())


class IndexedDatasetWriter:
    """Writes `<prefix>.bin` / `<prefix>.idx`, one sequence per document (GPT-NeoX `preprocess_data` layout).

    Use as a context manager: a clean exit finalizes, an exception discards everything written.
    """

    def __init__(self, prefix: PathLike, dtype):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # refuses float / unknown dtypes before any file is created
        self.bin_path, self.idx_path = _paths(prefix)
        self._info = np.iinfo(self.dtype)
        self._sizes: list[int] = []
        # readers look for the .idx first: it goes last, and no stale pair is ever visible
        self._outputs = AtomicOutputs(key=self.idx_path)
        self._bin = open(self._outputs.temp_for(self.bin_path), "wb")
        self._done = False

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()

    def add_document(self, tokens) -> None:
        """Append one document (one sequence) of integer tokens; values outside the dtype's range are refused."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"{self.bin_path}: document {len(self._sizes)} has shape {arr.shape}, expected a 1-D "
                             f"token list")
        self.add_documents(arr, [arr.size])

    def add_documents(self, tokens, lengths) -> None:
        """Append several documents at once: `tokens` concatenated, `lengths` the size of each."""
        if self._done:
            raise RuntimeError(f"{self.idx_path}: writer is already finalized or aborted")
        doc = len(self._sizes)
        arr, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if arr.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != arr.size:
            raise ValueError(f"{self.bin_path}: documents from {doc}: {arr.size} tokens do not add up to the "
                             f"lengths given ({int(lengths.sum())})")
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"{self.bin_path}: document {doc} holds {arr.dtype}, not integer tokens")
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"{self.bin_path}: document {doc + int(lengths.argmax())} has {lengths.max()} tokens, "
                             f"more than 2**31 - 1")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._info.min or hi > self._info.max:
                bad = int(np.searchsorted(np.cumsum(lengths), int(np.flatnonzero(
                    (arr < self._info.min) | (arr > self._info.max))[0]), side="right"))
                raise ValueError(f"{self.bin_path}: document {doc + bad} holds tokens in [{lo}, {hi}], outside "
                                 f"{self.dtype}'s range [{self._info.min}, {self._info.max}]")
        self._bin.write(arr.astype(_le(self.dtype), copy=False).tobytes())
        self._sizes.extend(lengths.tolist())

    def __len__(self) -> int:
        return len(self._sizes)

    def finalize(self) -> None:
        """Write the index and move both files onto their final names."""
        if self._done:
            raise RuntimeError(f"{self.idx_path}: writer is already finalized or aborted")
        self._done = True
        with self._outputs:
            self._bin.close()
            n = len(self._sizes)
            _write_index(self._outputs.temp_for(self.idx_path), self.dtype, np.array(self._sizes, dtype=np.int64),
                         np.arange(n + 1))

    def abort(self) -> None:
        """Discard everything written; the final names are left untouched."""
        self._done = True
        self._bin.close()
        self._outputs.discard()


# --- reading ---------------------------------------------------------------------------------------------------

class IndexedDataset:
    """A read-only, memory-mapped `<prefix>.bin` / `<prefix>.idx` pair.

    `doc_idx` holds, for each document, the sequence index it starts at, plus the end sentinel N. GPT-NeoX's
    `merge_datasets.py` writes `doc_idx = [0]`; such files are accepted with one document per sequence, and
    `doc_idx_from_file` is then False.
    """

    def __init__(self, prefix: PathLike):
        self.prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = _paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} does not exist (indexed datasets are named by their prefix, "
                                        f"without .bin/.idx)")
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < len(MAGIC) and MAGIC.startswith(head):
            raise ValueError(f"{self.idx_path}: truncated: {len(head)} bytes, shorter than the "
                             f"{HEADER_SIZE}-byte header")
        if head[:len(MAGIC)] != MAGIC:
            hint = " (the legacy 'cached' TNTIDX format is not supported)" if head.startswith(b"TNTIDX") else ""
            raise ValueError(f"{self.idx_path}: not an MMIDIDX index: starts with {head[:len(MAGIC)]!r}, "
                             f"expected {MAGIC!r}{hint}")
        if len(head) < HEADER_SIZE:
            raise ValueError(f"{self.idx_path}: truncated: {len(head)} bytes, shorter than the "
                             f"{HEADER_SIZE}-byte header")
        _, version, code, n, d = HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{self.idx_path}: index version {version}, only version {VERSION} is supported")
        self.dtype = _dtype_of_code(code, self.idx_path)
        expected = HEADER_SIZE + 12 * n + 8 * d
        actual = self.idx_path.stat().st_size
        if actual != expected:
            what = "truncated" if actual < expected else "has trailing bytes"
            hint = " (Megatron-LM multimodal modes are not supported)" if actual == expected + n else ""
            raise ValueError(f"{self.idx_path}: {what}: {actual} bytes, but a header with N={n} sequences and "
                             f"D={d} doc_idx entries needs {expected}{hint}")

        self._idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.sizes: np.ndarray = np.frombuffer(self._idx, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.pointers: np.ndarray = np.frombuffer(self._idx, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        raw_doc_idx = np.frombuffer(self._idx, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)

        if n and self.sizes.min() < 0:
            raise ValueError(f"{self.idx_path}: negative sequence size")
        itemsize = self.dtype.itemsize
        self.num_tokens = int(self.sizes.sum(dtype=np.int64))
        bin_bytes = self.bin_path.stat().st_size
        if bin_bytes != self.num_tokens * itemsize:
            raise ValueError(f"{self.bin_path}: {bin_bytes} bytes, but {self.idx_path.name} describes "
                             f"{self.num_tokens} {self.dtype} tokens = {self.num_tokens * itemsize} bytes")
        if n and (self.pointers[0] != 0 or
                  int(self.pointers[-1]) + int(self.sizes[-1]) * itemsize != bin_bytes):
            raise ValueError(f"{self.idx_path}: sequence pointers do not match the sizes")

        if d == 1 and raw_doc_idx[0] == 0 and n > 0:
            self.doc_idx: np.ndarray = np.arange(n + 1, dtype=np.int64)  # GPT-NeoX merged file
            self.doc_idx_from_file = False
        else:
            if d == 0 or raw_doc_idx[0] != 0 or raw_doc_idx[-1] != n or np.any(np.diff(raw_doc_idx) < 0):
                shown = raw_doc_idx[:3].tolist() + (["..."] + raw_doc_idx[-2:].tolist() if d > 5 else
                                                    raw_doc_idx[3:].tolist())
                raise ValueError(f"{self.idx_path}: doc_idx {shown} must rise from 0 to N={n} "
                                 f"(or be [0] as GPT-NeoX merged files are)")
            self.doc_idx = raw_doc_idx
            self.doc_idx_from_file = True

        if bin_bytes:
            self._tokens: np.ndarray = np.memmap(self.bin_path, dtype=_le(self.dtype), mode="r")
        else:  # an empty file cannot be memory-mapped
            self._tokens = np.zeros(0, dtype=_le(self.dtype))
            self._tokens.flags.writeable = False

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def _start(self, i: int) -> tuple[int, int]:
        n = len(self.sizes)
        if not -n <= i < n:
            raise IndexError(f"{self.prefix}: sequence {i} out of range for {n} sequences")
        i %= n
        return int(self.pointers[i]) // self.dtype.itemsize, int(self.sizes[i])

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence i as a read-only view of the `.bin`."""
        start, size = self._start(i)
        return self._tokens[start:start + size]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence i (to its end when length is None)."""
        start, size = self._start(i)
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) out of range for sequence {i} "
                             f"of {size} tokens")
        return self._tokens[start + offset:start + offset + length]

    def tokens(self) -> np.ndarray:
        """The whole `.bin` as one 1-D read-only array."""
        return self._tokens


def merge_indexed(prefixes: Iterable[PathLike], out_prefix: PathLike) -> None:
    """Concatenate datasets of one dtype into `out_prefix`, with doc_idx shifted as Megatron-LM's `add_index`."""
    datasets = [IndexedDataset(p) for p in prefixes]
    if not datasets:
        raise ValueError("merge_indexed needs at least one dataset")
    bin_path, idx_path = _paths(out_prefix)
    for ds in datasets:
        if ds.dtype != datasets[0].dtype:
            raise ValueError(f"cannot merge {ds.idx_path} ({ds.dtype}) with {datasets[0].idx_path} "
                             f"({datasets[0].dtype}): dtypes differ")
        if ds.idx_path.resolve() == idx_path.resolve():
            raise ValueError(f"{idx_path}: the output of a merge cannot be one of its inputs")
    sizes = np.concatenate([np.asarray(ds.sizes, dtype=np.int64) for ds in datasets])
    doc_idx, offset = [np.zeros(1, dtype=np.int64)], 0
    for ds in datasets:
        doc_idx.append(offset + np.asarray(ds.doc_idx[1:], dtype=np.int64))
        offset += len(ds)
    with AtomicOutputs(key=idx_path) as outputs:
        with open(outputs.temp_for(bin_path), "wb") as out:
            for ds in datasets:
                with open(ds.bin_path, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        _write_index(outputs.temp_for(idx_path), datasets[0].dtype, sizes, np.concatenate(doc_idx))


# --- llm.c / modded-nanogpt shards and raw nanoGPT bins ----------------------------------------------------------

def read_llmc_shard(path: PathLike) -> np.ndarray:
    """The uint16 tokens of an llm.c / modded-nanogpt shard: 256 little-endian int32 header, then the tokens."""
    path = Path(path)
    size = path.stat().st_size
    if size < LLMC_HEADER_BYTES:
        raise ValueError(f"{path}: truncated: {size} bytes, shorter than the {LLMC_HEADER_BYTES}-byte llm.c header")
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    magic, version, count = (int(x) for x in header[:3])
    if magic != LLMC_MAGIC:
        raise ValueError(f"{path}: not an llm.c shard: magic {magic}, expected {LLMC_MAGIC}")
    if version != LLMC_VERSION:
        hint = " (version 2 holds uint32 LLaMA-3 tokens)" if version == 2 else ""
        raise ValueError(f"{path}: llm.c shard version {version}, only version {LLMC_VERSION} (uint16) is "
                         f"supported{hint}")
    expected = LLMC_HEADER_BYTES + 2 * count
    if count < 0 or size != expected:
        raise ValueError(f"{path}: header says {count} tokens ({expected} bytes in all), but the file has "
                         f"{size} bytes")
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))


def write_llmc_shard(path: PathLike, tokens) -> None:
    """Write an llm.c shard (version 1, uint16 tokens) atomically."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{path}: tokens must be a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 65535):
        raise ValueError(f"{path}: tokens in [{int(arr.min())}, {int(arr.max())}] do not fit uint16")
    if arr.size > np.iinfo(np.int32).max:
        raise ValueError(f"{path}: {arr.size} tokens do not fit the int32 count of the header")
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (LLMC_MAGIC, LLMC_VERSION, arr.size)
    with AtomicOutputs() as outputs, open(outputs.temp_for(path), "wb") as f:
        f.write(header.tobytes())
        f.write(arr.astype("<u2", copy=False).tobytes())


def read_nanogpt_bin(path: PathLike) -> np.memmap:
    """A raw nanoGPT `train.bin` / `val.bin`: headerless little-endian uint16 tokens."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path}: empty file, no tokens")
    if size % 2:
        raise ValueError(f"{path}: {size} bytes is odd, not a whole number of uint16 tokens")
    return np.memmap(path, dtype="<u2", mode="r")
