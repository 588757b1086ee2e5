"""Bad input to `maester data`: every kind of bad record is named by file and line (or row), stops the run with
exit code 2 and leaves no output; with --skip-invalid it is skipped and counted by reason."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from maester.data.indexed import IndexedDataset
from maester.data.records import RecordReader
from tests.helpers import REPO, clean_env
from tests.tools.test_data_commands import BYTE, data, summary_of

GOOD = b'{"text": "good one"}\n'

# name: (bad line, reason counted with --skip-invalid, words of the error message)
BAD_LINES = {
    "malformed JSON": (b'{"text": "unterminated\n', "malformed JSON", "malformed JSON"),
    "missing field": (b'{"body": "no text key"}\n', "missing field", "no field 'text'"),
    "invalid UTF-8": (b'{"text": "caf\xe9"}\n', "invalid UTF-8", "not valid UTF-8"),
    "lone surrogate": (b'{"text": "a\\ud800b"}\n', "invalid UTF-8", "lone surrogate"),
    "empty document": (b'{"text": ""}\n', "empty document", "empty document"),
    "null text": (b'{"text": null}\n', "not text", "holds null"),
    "number text": (b'{"text": 42}\n', "not text", "holds int"),
    "blank line": (b"\n", "blank line", "blank line"),
    "not an object": (b'["text"]\n', "not a JSON object", "not an object"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_jsonl_line_is_named_by_file_and_line_and_leaves_no_output(tmp_path, capsys, case):
    bad, _, words = BAD_LINES[case]
    source = tmp_path / "in.jsonl"
    source.write_bytes(GOOD * 3 + bad + GOOD)
    out_dir = tmp_path / "out"
    code, out, err = data(capsys, "tokenize", source, "--output-prefix", out_dir / "o", "--tokenizer", "byte",
                          "--chunk-size", 2)  # a chunk is written before the bad line is read
    assert code == 2
    assert err.startswith(f"maester data: error: {source}:4: ") and words in err, err
    assert out == ""
    assert list(out_dir.iterdir()) == []  # no .bin/.idx, and no temporary file left behind


def test_a_bad_line_read_ahead_for_worker_processes_stops_the_run_the_same_way(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(GOOD * 7 + b'{"text": "caf\xe9"}\n' + GOOD)
    code, out, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "out" / "o", "--tokenizer",
                          "byte", "--workers", 2, "--chunk-size", 2)
    assert code == 2 and out == ""
    assert err.startswith(f"maester data: error: {source}:8: not valid UTF-8"), err
    assert list((tmp_path / "out").iterdir()) == []


def test_skip_invalid_counts_each_reason_and_keeps_only_valid_documents(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    valid = [f"document {i}" for i in range(len(BAD_LINES) + 1)]
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in valid]
    mixed = [line for pair in zip(lines, [b for b, _, _ in BAD_LINES.values()] + [b""], strict=True) for line in pair]
    source.write_bytes(b"".join(mixed))
    code, out, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "o", "--tokenizer", "byte",
                          "--skip-invalid", "--workers", 2, "--chunk-size", 3)
    assert code == 0, err
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [BYTE.encode(t) for t in valid]
    line = out.strip().splitlines()[-1]
    assert ("skipped=9 (blank line: 1, empty document: 1, invalid UTF-8: 2, malformed JSON: 1, missing field: 1, "
            "not a JSON object: 1, not text: 2)") in line
    assert summary_of(out, "tokenize")["documents"] == str(len(valid))


def test_skip_invalid_in_count_and_convert(tmp_path, capsys):
    source = tmp_path / "in.jsonl.gz"
    source.write_bytes(gzip.compress(GOOD + b'{"text": ""}\n' + GOOD + b"{oops\n"))
    code, out, err = data(capsys, "count", source, "--tokenizer", "byte", "--skip-invalid")
    assert code == 0, err
    assert "documents=2 " in out and "skipped=2 (empty document: 1, malformed JSON: 1)" in out
    code, out, err = data(capsys, "convert", source, "--output-dir", tmp_path / "c", "--to", "jsonl",
                          "--skip-invalid")
    assert code == 0, err
    lines = (tmp_path / "c" / "part-00000.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"text": "good one"}] * 2
    assert "skipped=2 (empty document: 1, malformed JSON: 1)" in out
    code, _, err = data(capsys, "convert", source, "--output-dir", tmp_path / "d", "--to", "parquet")
    assert code == 2 and f"{source}:2: " in err and not (tmp_path / "d").exists()


def test_bad_parquet_rows_are_named_by_row(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["fine", "also fine", None, ""]}), source)
    code, _, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "o", "--tokenizer", "byte")
    assert code == 2 and f"{source}: row 2: " in err and "holds null" in err
    code, out, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "o", "--tokenizer", "byte",
                          "--skip-invalid")
    assert code == 0, err
    assert "documents=2 " in out and "skipped=2 (empty document: 1, not text: 1)" in out


def test_parquet_without_the_text_column(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": ["x"]}), source)
    code, _, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "o", "--tokenizer", "byte",
                        "--skip-invalid")
    assert code == 2 and str(source) in err and "no column 'text'" in err and "body" in err
    code, out, err = data(capsys, "count", source, "--tokenizer", "byte", "--text-key", "body")
    assert code == 0 and "documents=1 " in out


UNREADABLE = {
    "garbage.parquet": b"this is not parquet at all",
    "truncated.parquet": None,
    "truncated.jsonl.gz": gzip.compress(GOOD * 50, mtime=0)[:-12],
    "corrupt.jsonl.gz": gzip.compress(GOOD * 50, mtime=0)[:12] + b"\xff" * 20,
    "truncated.jsonl.zst": zstandard.ZstdCompressor().compress(GOOD * 50)[:-6],
    "garbage.jsonl.zst": b"not zstd data",
}


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_unreadable_files_are_named(tmp_path, capsys, name):
    source, content = tmp_path / name, UNREADABLE[name]
    if content is None:  # a real Parquet file cut in half
        pq.write_table(pa.table({"text": ["x" * 100] * 100}), tmp_path / "whole.parquet")
        content = (tmp_path / "whole.parquet").read_bytes()
        content = content[: len(content) // 2]
    source.write_bytes(content)
    code, out, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "out" / "o", "--tokenizer",
                          "byte", "--skip-invalid")  # a broken file is never skipped
    assert code == 2, out
    assert err.startswith(f"maester data: error: {source}: ")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_inputs_that_do_not_exist_or_have_unknown_suffixes(tmp_path, capsys):
    code, _, err = data(capsys, "tokenize", tmp_path / "missing.jsonl", "--output-prefix", tmp_path / "o",
                        "--tokenizer", "byte")
    assert code == 2 and "missing.jsonl: no such file or directory" in err
    (tmp_path / "notes.md").write_text("hello")
    code, _, err = data(capsys, "count", tmp_path / "notes.md", "--tokenizer", "byte")
    assert code == 2 and "cannot tell the format" in err
    code, _, err = data(capsys, "count", tmp_path / "*.jsonl", "--tokenizer", "byte")
    assert code == 2 and "matches no files" in err


def test_reader_expands_directories_and_globs_in_sorted_order(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.jsonl", "d/a.jsonl.gz", "d/sub/c.parquet"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "d" / "README.md").write_text("ignored in a directory")
    files = RecordReader([tmp_path / "d", str(tmp_path / "d" / "*.jsonl")]).files
    assert [p.relative_to(tmp_path).as_posix() for p in files] == [
        "d/a.jsonl.gz", "d/b.jsonl", "d/sub/c.parquet", "d/b.jsonl"]


def test_the_installed_command_exits_2_naming_file_and_line(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(GOOD + b'{"text": "caf\xe9"}\n')
    result = subprocess.run([sys.executable, "-m", "maester", "data", "tokenize", str(source), "--output-prefix",
                             str(tmp_path / "o"), "--tokenizer", "byte"], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"maester data: error: {source}:2: not valid UTF-8 (byte 13 of the line)")
    assert result.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
