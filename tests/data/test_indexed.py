"""Megatron / GPT-NeoX `.bin/.idx`, llm.c shards, nanoGPT bins: exact bytes, round trips, refusals naming the file."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from maester.data.indexed import (DTYPE_CODES, IndexedDataset, IndexedDatasetWriter, best_dtype, merge_indexed,
                                  read_llmc_shard, read_nanogpt_bin, write_llmc_shard)

MAGIC = b"MMIDIDX\x00\x00"


def hand_idx(code: int, sizes: list[int], pointers: list[int], doc_idx: list[int], *, magic: bytes = MAGIC,
             version: int = 1) -> bytes:
    """An .idx built field by field from the spec, independently of the writer."""
    n, d = len(sizes), len(doc_idx)
    return (magic + struct.pack("<Q", version) + struct.pack("<B", code) + struct.pack("<Q", n)
            + struct.pack("<Q", d) + struct.pack(f"<{n}i", *sizes) + struct.pack(f"<{n}q", *pointers)
            + struct.pack(f"<{d}q", *doc_idx))


def write_pair(tmp_path: Path, name: str, idx: bytes, bin_bytes: bytes) -> Path:
    prefix = tmp_path / name
    Path(f"{prefix}.idx").write_bytes(idx)
    Path(f"{prefix}.bin").write_bytes(bin_bytes)
    return prefix


def write_docs(prefix: Path, docs: list, dtype) -> Path:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
    return prefix


# --- golden bytes ----------------------------------------------------------------------------------------------

def test_golden_bytes_of_the_worked_example(tmp_path):
    prefix = write_docs(tmp_path / "ex_text_document", [[1, 2, 3], [4, 5]], np.uint16)
    idx = Path(f"{prefix}.idx").read_bytes()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2, 3) + struct.pack("<ii", 3, 2)
                + struct.pack("<qq", 0, 6) + struct.pack("<qqq", 0, 1, 2))
    assert len(expected) == 82
    assert len(idx) == 82
    assert idx == expected
    assert idx[:34] == b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2, 3)
    assert len(idx[:34]) == 34
    assert Path(f"{prefix}.bin").read_bytes() == struct.pack("<5H", 1, 2, 3, 4, 5)
    assert len(Path(f"{prefix}.bin").read_bytes()) == 10

    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert ds.sizes.tolist() == [3, 2]
    assert ds.pointers.tolist() == [0, 6]
    assert ds.doc_idx.tolist() == [0, 1, 2]
    assert len(ds) == 2 and ds.num_tokens == 5 and ds.num_documents == 2
    assert ds[0].tolist() == [1, 2, 3] and ds[1].tolist() == [4, 5] and ds[-1].tolist() == [4, 5]
    assert ds.get(0, 1, 2).tolist() == [2, 3] and ds.get(1, 1).tolist() == [5]
    assert ds.tokens().tolist() == [1, 2, 3, 4, 5]


def test_reference_hexdump_matches():
    """The spec's hexdump (reference doc A.3) equals the hand-packed bytes used above."""
    dump = """4d 4d 49 44 49 44 58 00 00 01 00 00 00 00 00 00 00 08 02 00 00 00 00 00 00 00 03 00 00 00 00 00
              00 00 03 00 00 00 02 00 00 00 00 00 00 00 00 00 00 00 06 00 00 00 00 00 00 00 00 00 00 00 00 00
              00 00 01 00 00 00 00 00 00 00 02 00 00 00 00 00 00 00"""
    assert bytes.fromhex(dump) == hand_idx(8, [3, 2], [0, 6], [0, 1, 2])


# --- round trips and dtype choice ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.int64, np.uint16, np.int8])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -(2 ** 40)), min(info.max, 2 ** 40)
    docs = [rng.integers(lo, hi, size=int(rng.integers(0, 50)), endpoint=True, dtype=np.int64) for _ in range(30)]
    prefix = write_docs(tmp_path / "rt", docs, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 30 and ds.doc_idx.tolist() == list(range(31))
    assert ds.sizes.tolist() == [len(d) for d in docs]
    for i, doc in enumerate(docs):
        assert ds[i].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.tokens(), np.concatenate(docs))
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[17] == {v: k for k, v in DTYPE_CODES.items()}[np.dtype(dtype)]


def test_dtype_codes_and_best_dtype():
    assert {k: str(v) for k, v in DTYPE_CODES.items()} == {1: "uint8", 2: "int8", 3: "int16", 4: "int32",
                                                           5: "int64", 8: "uint16"}
    assert best_dtype(50257) == np.uint16 and DTYPE_CODES[8] == best_dtype(50257)
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and DTYPE_CODES[4] == best_dtype(65500)
    assert best_dtype(128256) == np.int32


def test_empty_dataset_round_trips(tmp_path):
    ds = IndexedDataset(write_docs(tmp_path / "empty", [], np.uint16))
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.doc_idx.tolist() == [0] and len(ds.tokens()) == 0
    assert len(Path(f"{tmp_path / 'empty'}.idx").read_bytes()) == 34 + 8


# --- refusals --------------------------------------------------------------------------------------------------

BIN_EX = struct.pack("<5H", 1, 2, 3, 4, 5)


@pytest.mark.parametrize("magic", [b"MMIDIDX\x00\x01", b"TNTIDX\x00\x00\x00", b"XXXXXXXXX"])
def test_refuses_bad_magic(tmp_path, magic):
    prefix = write_pair(tmp_path, "bad", hand_idx(8, [3, 2], [0, 6], [0, 1, 2], magic=magic), BIN_EX)
    with pytest.raises(ValueError, match=r"bad\.idx: not an MMIDIDX index") as e:
        IndexedDataset(prefix)
    assert repr(magic) in str(e.value)


def test_refuses_version_2(tmp_path):
    prefix = write_pair(tmp_path, "v2", hand_idx(8, [3, 2], [0, 6], [0, 1, 2], version=2), BIN_EX)
    with pytest.raises(ValueError, match=r"v2\.idx: index version 2"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("code", [6, 7])
def test_refuses_float_codes(tmp_path, code):
    prefix = write_pair(tmp_path, "fl", hand_idx(code, [1], [0], [0, 1]), b"\x00" * 8)
    with pytest.raises(ValueError, match=rf"fl\.idx: dtype code {code} means float.*refused"):
        IndexedDataset(prefix)


def test_refuses_unknown_code_and_float_writer(tmp_path):
    prefix = write_pair(tmp_path, "unk", hand_idx(9, [1], [0], [0, 1]), b"\x00" * 2)
    with pytest.raises(ValueError, match=r"unk\.idx: unknown dtype code 9"):
        IndexedDataset(prefix)
    with pytest.raises(ValueError, match="float32 cannot be stored"):
        IndexedDatasetWriter(tmp_path / "f", np.float32)
    assert list(tmp_path.glob("f*")) == list(tmp_path.glob(".f*")) == []


@pytest.mark.parametrize("cut", [5, 20, 81])
def test_refuses_truncated_idx(tmp_path, cut):
    prefix = write_pair(tmp_path, "tr", hand_idx(8, [3, 2], [0, 6], [0, 1, 2])[:cut], BIN_EX)
    with pytest.raises(ValueError, match=r"tr\.idx: truncated"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("bin_bytes", [BIN_EX[:-2], BIN_EX + b"\x00\x00", b""])
def test_refuses_bin_of_wrong_size(tmp_path, bin_bytes):
    prefix = write_pair(tmp_path, "ws", hand_idx(8, [3, 2], [0, 6], [0, 1, 2]), bin_bytes)
    with pytest.raises(ValueError, match=rf"ws\.bin: {len(bin_bytes)} bytes, but ws\.idx describes 5 uint16"):
        IndexedDataset(prefix)


def test_refuses_bad_doc_idx_and_missing_files(tmp_path):
    prefix = write_pair(tmp_path, "di", hand_idx(8, [3, 2], [0, 6], [0, 1]), BIN_EX)
    with pytest.raises(ValueError, match=r"di\.idx: doc_idx \[0, 1\] must rise from 0 to N=2"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"nothere\.idx does not exist"):
        IndexedDataset(tmp_path / "nothere")


@pytest.mark.parametrize("dtype,bad,doc", [(np.uint16, [-1], 1), (np.uint16, [65536], 1), (np.uint8, [256], 1),
                                           (np.int16, [40000], 1), (np.int32, [2 ** 31], 1)])
def test_refuses_token_out_of_range(tmp_path, dtype, bad, doc):
    with pytest.raises(ValueError, match=rf"document {doc} holds tokens in \[.*outside"):
        with IndexedDatasetWriter(tmp_path / "oor", dtype) as w:
            w.add_document([1, 2])
            w.add_document(bad)
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_integer_tokens(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ni", np.uint16) as w:
        with pytest.raises(ValueError, match=r"document 0 holds float64, not integer tokens"):
            w.add_document([1.0, 2.5])
        w.add_document([1, 2])
    assert IndexedDataset(tmp_path / "ni")[0].tolist() == [1, 2]


# --- merged files ----------------------------------------------------------------------------------------------

def test_accepts_neox_merged_doc_idx_zero(tmp_path):
    prefix = write_pair(tmp_path, "merged", hand_idx(8, [3, 2], [0, 6], [0]), BIN_EX)
    ds = IndexedDataset(prefix)
    assert ds.doc_idx.tolist() == [0, 1, 2] and not ds.doc_idx_from_file
    assert ds[1].tolist() == [4, 5]
    assert IndexedDataset(write_docs(tmp_path / "plain", [[1]], np.uint16)).doc_idx_from_file


def test_merge_shifts_doc_idx(tmp_path):
    a = write_docs(tmp_path / "a", [[1, 2, 3], [4]], np.uint16)
    # A Megatron sentence-level file: 3 sequences in 2 documents, doc_idx [0, 2, 3].
    b = write_pair(tmp_path, "b", hand_idx(8, [2, 1, 3], [0, 4, 6], [0, 2, 3]), struct.pack("<6H", 5, 6, 7, 8, 9, 10))
    c = write_pair(tmp_path, "c", hand_idx(8, [1, 2], [0, 2], [0]), struct.pack("<3H", 11, 12, 13))  # NeoX merged
    merge_indexed([a, b, c], tmp_path / "out")
    ds = IndexedDataset(tmp_path / "out")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4], [5, 6], [7], [8, 9, 10], [11], [12, 13]]
    assert ds.sizes.tolist() == [3, 1, 2, 1, 3, 1, 2]
    assert ds.pointers.tolist() == [0, 6, 8, 12, 14, 20, 22]
    assert ds.doc_idx.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert ds.doc_idx_from_file


def test_merge_refuses_mixed_dtypes_and_empty_list(tmp_path):
    a = write_docs(tmp_path / "a", [[1]], np.uint16)
    b = write_docs(tmp_path / "b", [[1]], np.int32)
    with pytest.raises(ValueError, match=r"b\.idx \(int32\).*a\.idx \(uint16\): dtypes differ"):
        merge_indexed([a, b], tmp_path / "out")
    with pytest.raises(ValueError, match="at least one"):
        merge_indexed([], tmp_path / "out")
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))


# --- atomicity -------------------------------------------------------------------------------------------------

def test_failed_write_leaves_no_files(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetWriter(tmp_path / "crash", np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_failed_rewrite_keeps_the_old_pair(tmp_path):
    write_docs(tmp_path / "keep", [[7, 8]], np.uint16)
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "keep", np.uint16) as w:
            w.add_document([1])
            raise RuntimeError("boom")
    assert IndexedDataset(tmp_path / "keep")[0].tolist() == [7, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.bin", "keep.idx"]
    write_docs(tmp_path / "keep", [[1], [2]], np.uint16)
    assert IndexedDataset(tmp_path / "keep").tokens().tolist() == [1, 2]


# --- llm.c shards and nanoGPT bins -----------------------------------------------------------------------------

def test_llmc_shard_round_trip(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 50257, size=1000)
    write_llmc_shard(tmp_path / "s.bin", tokens)
    raw = (tmp_path / "s.bin").read_bytes()
    assert len(raw) == 1024 + 2000
    assert struct.unpack("<3i", raw[:12]) == (20240520, 1, 1000) and raw[12:1024] == bytes(1012)
    out = read_llmc_shard(tmp_path / "s.bin")
    assert out.dtype == np.uint16
    np.testing.assert_array_equal(out, tokens)
    write_llmc_shard(tmp_path / "e.bin", [])
    assert len(read_llmc_shard(tmp_path / "e.bin")) == 0
    with pytest.raises(ValueError, match=r"x\.bin: tokens in \[0, 70000\] do not fit uint16"):
        write_llmc_shard(tmp_path / "x.bin", [0, 70000])
    assert not (tmp_path / "x.bin").exists()


def test_llmc_shard_refusals(tmp_path):
    def shard(name: str, magic: int, version: int, count: int, ntok: int) -> Path:
        p = tmp_path / name
        p.write_bytes(struct.pack("<3i", magic, version, count) + bytes(1012) + bytes(2 * ntok))
        return p

    with pytest.raises(ValueError, match=r"magic\.bin: not an llm\.c shard: magic 20240521"):
        read_llmc_shard(shard("magic.bin", 20240521, 1, 4, 4))
    with pytest.raises(ValueError, match=r"v2\.bin: llm\.c shard version 2"):
        read_llmc_shard(shard("v2.bin", 20240520, 2, 4, 4))
    with pytest.raises(ValueError, match=r"short\.bin: header says 10 tokens .* file has 1032 bytes"):
        read_llmc_shard(shard("short.bin", 20240520, 1, 10, 4))
    (tmp_path / "tiny.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match=r"tiny\.bin: truncated: 100 bytes"):
        read_llmc_shard(tmp_path / "tiny.bin")


def test_nanogpt_bin(tmp_path):
    tokens = np.array([0, 1, 50256, 65535], dtype="<u2")
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    out = read_nanogpt_bin(tmp_path / "train.bin")
    assert out.dtype == np.uint16 and out.tolist() == tokens.tolist()
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"odd\.bin: 7 bytes is odd"):
        read_nanogpt_bin(tmp_path / "odd.bin")


# --- read-only access ------------------------------------------------------------------------------------------

def test_reads_read_only_files(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    prefix = write_docs(d / "ds", [[1, 2, 3], [4, 5]], np.uint16)
    write_llmc_shard(d / "s.bin", [1, 2])
    paths = [d / "ds.bin", d / "ds.idx", d / "s.bin"]
    for p in paths:
        p.chmod(0o444)
    d.chmod(0o555)
    try:
        chmod_effective = not os.access(d / "ds.idx", os.W_OK) and not os.access(d, os.W_OK)
        ds = IndexedDataset(prefix)
        assert ds[0].tolist() == [1, 2, 3] and read_llmc_shard(d / "s.bin").tolist() == [1, 2]
        assert not ds.tokens().flags.writeable and not ds[0].flags.writeable and not ds.sizes.flags.writeable
        if chmod_effective:  # as root chmod does not take write access away; the flags above still hold
            assert ds.tokens().tolist() == [1, 2, 3, 4, 5]
    finally:
        d.chmod(stat.S_IRWXU)
        for p in paths:
            p.chmod(0o644)


def test_add_documents_in_bulk_writes_the_same_bytes_as_one_by_one(tmp_path):
    docs = [np.arange(i, i + 3 * i + 1) % 300 for i in range(50)]
    with IndexedDatasetWriter(tmp_path / "one", np.uint16) as w:
        for d in docs:
            w.add_document(d)
    with IndexedDatasetWriter(tmp_path / "bulk", np.uint16) as w:
        w.add_documents(np.concatenate(docs[:20]), [len(d) for d in docs[:20]])
        w.add_documents(np.concatenate(docs[20:]), [len(d) for d in docs[20:]])
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"bulk{suffix}").read_bytes()
    with IndexedDatasetWriter(tmp_path / "bad", np.uint8) as w:
        with pytest.raises(ValueError, match=r"document 2 holds tokens in"):
            w.add_documents(np.array([1, 2, 3, 4, 300, 5]), [2, 2, 2])
        with pytest.raises(ValueError, match="do not add up"):
            w.add_documents(np.array([1, 2, 3]), [2, 2])
