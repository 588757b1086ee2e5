"""Pretraining and `maester data` read JSONL and Parquet through one reader: for each way the files can differ
(suffix case, a byte order mark, hidden files, `.gz`/`.zst`, a bad record), the same documents or the same error
on both paths. Each case has one test through pretraining (the text source and loader built from a data source
config) and one through the tools (`RecordReader`, `maester data count`)."""

from __future__ import annotations

import codecs
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from maester.config import DataConfig, DataSourceConfig, TokenizerConfig
from maester.data.batch import BatchPlan
from maester.data.loader import build_loader
from maester.data.records import TEXT_KEY_HINT, InvalidDocument, InvalidRecord, RecordReader, UnreadableFile
from maester.data.text_files import TEXT_COLUMN_HINT, TextSource
from maester.data.tokenizers import ByteTokenizer
from tests.tools.test_data_commands import data, summary_of

TOK = ByteTokenizer()


def jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def write_parquet(path: Path, texts: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), path)
    return path


def zstd_frames(*parts: bytes) -> bytes:
    """A zstd file of one frame per part, as concatenated `.zst` files are."""
    return b"".join(zstandard.ZstdCompressor().compress(part) for part in parts)


# ---------------------------------------------------------------- the files: (input to read, its documents in order)

def suffix_case_directory(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "corpus"
    write(root / "A.JSONL", jsonl_bytes(["upper jsonl"]))
    write_parquet(root / "b.Parquet", ["mixed parquet"])
    write(root / "c.JSONL.GZ", gzip.compress(jsonl_bytes(["upper gz"]), mtime=0))
    write(root / "d.Jsonl.Zst", zstd_frames(jsonl_bytes(["mixed zst"])))
    return root, ["upper jsonl", "mixed parquet", "upper gz", "mixed zst"]


def suffix_case_file(tmp_path: Path) -> tuple[Path, list[str]]:
    return write_parquet(tmp_path / "CORPUS.PARQUET", ["one", "two"]), ["one", "two"]


def byte_order_mark(tmp_path: Path) -> tuple[Path, list[str]]:
    return write(tmp_path / "bom.jsonl", codecs.BOM_UTF8 + jsonl_bytes(["first", "second"])), ["first", "second"]


def hidden_files(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "corpus"
    write(root / "a.jsonl", jsonl_bytes(["visible"]))
    write(root / ".b.jsonl", jsonl_bytes(["hidden"]))
    write(root / "._a.parquet", b"\x00\x05\x16\x07 AppleDouble metadata, not Parquet")
    write(root / "sub" / ".c.jsonl.gz", gzip.compress(jsonl_bytes(["hidden too"])))
    write(root / "sub" / "d.jsonl", jsonl_bytes(["visible too"]))
    return root, ["visible", "visible too"]


SEVEN = [f"document {i}" for i in range(7)]


def gzip_file(tmp_path: Path) -> tuple[Path, list[str]]:
    return write(tmp_path / "docs.jsonl.gz", gzip.compress(jsonl_bytes(SEVEN), mtime=0)), SEVEN


def zstd_file(tmp_path: Path) -> tuple[Path, list[str]]:
    return write(tmp_path / "docs.jsonl.zst", zstd_frames(jsonl_bytes(SEVEN[:4]), jsonl_bytes(SEVEN[4:]))), SEVEN


CORPORA = {f.__name__: f for f in (suffix_case_directory, suffix_case_file, byte_order_mark, hidden_files,
                                   gzip_file, zstd_file)}


def loader(path: Path, *, seq_len: int = 8, global_batch: int = 1, **data_kw):
    cfg = DataConfig(sources=[DataSourceConfig(path=str(path))], seq_len=seq_len, num_workers=0,
                     chunk_documents=3, **data_kw)
    return build_loader(cfg, TokenizerConfig(kind="byte"), TOK, seed=0, batch=BatchPlan(global_batch, global_batch))


def whole_documents(tokens: list[int]) -> set[str]:
    """The documents of consecutive windows' tokens (EOS after each), but the last, which may be cut."""
    return set(bytes(t if t < 256 else 0 for t in tokens).decode().split("\x00")[:-1])


def trained_documents(path: Path, expected: list[str]) -> set[str]:
    """The documents of the first windows trained on, enough for every document to come at least once."""
    ld = loader(path)
    need, tokens = 3 * sum(len(t) + 1 for t in expected), []
    while len(tokens) < need:
        tokens += ld.next_step()[0].input_ids[0].tolist()
    return whole_documents(tokens)


@pytest.mark.parametrize("case", list(CORPORA))
def test_pretraining_reads_the_documents_the_tools_read(tmp_path, case):
    path, expected = CORPORA[case](tmp_path)
    source = TextSource(DataSourceConfig(path=str(path)), chunk_documents=3)
    assert list(source.documents()) == expected
    assert trained_documents(path, expected) == set(expected)


@pytest.mark.parametrize("case", list(CORPORA))
def test_tools_read_the_documents_pretraining_reads(tmp_path, capsys, case):
    path, expected = CORPORA[case](tmp_path)
    assert list(RecordReader([path]).texts()) == expected
    code, out, err = data(capsys, "count", path, "--tokenizer", "byte")
    assert code == 0, err
    assert summary_of(out, "count")["documents"] == str(len(expected))


# ---------------------------------------------------------------- bad records: the same error on both paths

# name: (the bad second line, reason, the message after `file:2: `; {hint} is how each path names another field)
BAD_LINES = {
    "malformed JSON": (b'{"text": "unterminated\n', "malformed JSON",
                       "malformed JSON: Invalid control character at: line 1 column 23 (char 22)"),
    "not an object": (b'["text"]\n', "not a JSON object", "a JSON list, not an object"),
    "missing field": (b'{"body": "x"}\n', "missing field", "record has no field 'text' (fields: body); {hint}"),
    "a conversation": (b'{"messages": []}\n', "missing field",
                       "record has no field 'text' (fields: messages); it holds 'messages': a conversation where a "
                       "text record was expected"),
    "invalid UTF-8": (b'{"text": "caf\xe9"}\n', "invalid UTF-8", "not valid UTF-8 (byte 13 of the line)"),
    "lone surrogate": (b'{"text": "a\\ud800b"}\n', "invalid UTF-8",
                       "field 'text' holds a lone surrogate at character 1, not valid UTF-8"),
    "empty document": (b'{"text": ""}\n', "empty document", "field 'text' is an empty document"),
    "null text": (b'{"text": null}\n', "not text", "field 'text' holds null, not text"),
    "blank line": (b"\r\n", "blank line", "blank line, not a JSON record"),
}


def bad_file(tmp_path: Path, case: str, suffix: str) -> Path:
    content = jsonl_bytes(["ok"]) + BAD_LINES[case][0] + jsonl_bytes(["fine"])
    return write(tmp_path / f"bad.{suffix}", gzip.compress(content) if suffix.endswith(".gz") else content)


def assert_bad_record(error: BaseException, path: Path, case: str, hint: str) -> None:
    _, reason, message = BAD_LINES[case]
    assert isinstance(error, InvalidRecord) and isinstance(error, InvalidDocument)
    assert str(error) == f"{path}:2: " + message.format(hint=hint)
    assert error.reason == reason


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz"])
@pytest.mark.parametrize("case", list(BAD_LINES))
def test_pretraining_names_a_bad_record_as_the_tools_do(tmp_path, case, suffix):
    path = bad_file(tmp_path, case, suffix)
    records = list(TextSource(DataSourceConfig(path=str(path)), chunk_documents=3).documents())
    assert records[0] == "ok" and records[2] == "fine"
    assert_bad_record(records[1], path, case, TEXT_COLUMN_HINT)
    with pytest.raises(InvalidDocument) as err:
        for _ in range(10):
            loader(path).next_step()
    assert_bad_record(err.value, path, case, TEXT_COLUMN_HINT)
    skipping = loader(path, seq_len=40, skip_invalid=True)
    assert whole_documents(skipping.next_step()[0].input_ids[0].tolist()) == {"ok", "fine"}


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz"])
@pytest.mark.parametrize("case", list(BAD_LINES))
def test_tools_name_a_bad_record_as_pretraining_does(tmp_path, capsys, case, suffix):
    path = bad_file(tmp_path, case, suffix)
    with pytest.raises(InvalidDocument) as err:
        list(RecordReader([path]).texts())
    assert_bad_record(err.value, path, case, TEXT_KEY_HINT)
    reader = RecordReader([path], skip_invalid=True)
    assert list(reader.texts()) == ["ok", "fine"] and dict(reader.skipped) == {BAD_LINES[case][1]: 1}
    code, _, stderr = data(capsys, "count", path, "--tokenizer", "byte")
    assert code == 2 and stderr.strip() == f"maester data: error: {err.value}"


def bad_parquet(tmp_path: Path) -> Path:
    return write_parquet(tmp_path / "bad.parquet", ["ok", None, "fine"])


def test_pretraining_names_a_bad_parquet_row_as_the_tools_do(tmp_path):
    path = bad_parquet(tmp_path)
    records = list(TextSource(DataSourceConfig(path=str(path)), chunk_documents=3).documents())
    assert records[0] == "ok" and records[2] == "fine"
    assert isinstance(records[1], InvalidRecord) and records[1].reason == "not text"
    assert str(records[1]) == f"{path}: row 1: field 'text' holds null, not text"


def test_tools_name_a_bad_parquet_row_as_pretraining_does(tmp_path):
    path = bad_parquet(tmp_path)
    with pytest.raises(InvalidRecord) as err:
        list(RecordReader([path]).texts())
    assert err.value.reason == "not text"
    assert str(err.value) == f"{path}: row 1: field 'text' holds null, not text"


# ---------------------------------------------------------------- whole files that cannot be read

UNREADABLE = {
    "truncated.jsonl.gz": lambda: gzip.compress(jsonl_bytes(SEVEN), mtime=0)[:-12],
    "truncated.jsonl.zst": lambda: zstd_frames(jsonl_bytes(SEVEN))[:-6],
    "garbage.parquet": lambda: b"this is not parquet",
}


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_pretraining_refuses_an_unreadable_file_as_the_tools_do(tmp_path, name):
    path = write(tmp_path / name, UNREADABLE[name]())
    with pytest.raises(UnreadableFile, match=f"^{path}: (cannot be read|not a readable Parquet file)"):
        loader(path)


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_tools_refuse_an_unreadable_file_as_pretraining_does(tmp_path, name):
    path = write(tmp_path / name, UNREADABLE[name]())
    with pytest.raises(UnreadableFile, match=f"^{path}: (cannot be read|not a readable Parquet file)"):
        list(RecordReader([path], skip_invalid=True).texts())


def test_a_missing_text_column_is_the_same_error_with_each_path_s_hint(tmp_path):
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    message = f"{path}: no column 'text' (columns: body); "
    with pytest.raises(UnreadableFile) as err:
        TextSource(DataSourceConfig(path=str(path)), chunk_documents=3)
    assert str(err.value) == message + TEXT_COLUMN_HINT
    with pytest.raises(UnreadableFile) as err:
        list(RecordReader([path]).texts())
    assert str(err.value) == message + TEXT_KEY_HINT


def test_a_format_given_on_the_source_reads_an_odd_name_and_still_decompresses(tmp_path):
    notes = write(tmp_path / "notes.txt", jsonl_bytes(["from notes"]))
    packed = write(tmp_path / "more.jsonl.gz", gzip.compress(jsonl_bytes(["from gz"])))
    for path, expected in ((notes, ["from notes"]), (packed, ["from gz"])):
        source = TextSource(DataSourceConfig(path=str(path), format="jsonl"), chunk_documents=3)
        assert list(source.documents()) == expected
        assert list(RecordReader([path], fmt="jsonl").texts()) == expected


def test_a_compressed_file_read_in_many_chunks_says_what_it_costs(tmp_path, caplog):
    texts = [f"doc {i}" for i in range(20)]
    path = write(tmp_path / "big.jsonl.gz", gzip.compress(jsonl_bytes(texts)))
    with caplog.at_level("WARNING", logger="maester.data.text_files"):
        source = TextSource(DataSourceConfig(path=str(path)), chunk_documents=5)
        assert not caplog.records  # four chunks: not yet worth a warning
        source = TextSource(DataSourceConfig(path=str(path)), chunk_documents=2)
    assert [c.rows for c in source.chunks] == [2] * 10
    assert [str(path) in r.getMessage() and "10 chunks" in r.getMessage() for r in caplog.records] == [True]
    assert [d for c in reversed(source.chunks) for d in source.read(c)] == [t for k in range(9, -1, -1)
                                                                          for t in texts[2 * k:2 * k + 2]]
