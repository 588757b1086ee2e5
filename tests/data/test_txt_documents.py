"""Plain `.txt` inputs: one document per file, or one per paragraph with `split_on_blank_lines`, the same through
`maester data` (RecordReader) and pretraining (TextSource), with bad documents named by file and line."""

from __future__ import annotations

import codecs

import pytest

from maester.config import DataConfig, DataSourceConfig
from maester.data.records import InvalidRecord, RecordReader, resolve_inputs
from maester.data.text_files import TextSource
from tests.helpers import REPO

TEXT = "First paragraph,\nits second line.\n\n  \t\nSecond one.\r\n\r\n\r\nThird\n"
PARAGRAPHS = ["First paragraph,\nits second line.", "Second one.", "Third"]


def both_paths(path, split: bool) -> tuple[list, list]:
    """The documents as `maester data` reads them and as a pretraining source does (in chunks of 2)."""
    reader = RecordReader([path], split_on_blank_lines=split)
    source = TextSource(DataSourceConfig(path=str(path), split_on_blank_lines=split), chunk_documents=2)
    return [(d.text, d.where) for d in reader.documents()], list(source.documents())


def test_a_file_is_one_document_or_one_per_paragraph(tmp_path):
    path = tmp_path / "book.TXT"
    path.write_bytes(codecs.BOM_UTF8 + TEXT.encode())
    read, trained = both_paths(path, split=False)
    assert read == [(TEXT, f"{path}:1")] and trained == [TEXT]
    read, trained = both_paths(path, split=True)
    assert read == [(p, f"{path}:{line}") for p, line in zip(PARAGRAPHS, (1, 5, 8))]
    assert trained == PARAGRAPHS
    assert RecordReader([path], split_on_blank_lines=True).count_records() == 3
    assert [w for w, _ in RecordReader([path], split_on_blank_lines=True).records()] == [
        f"{path}:1", f"{path}:5", f"{path}:8"]


def test_bad_documents_are_named_by_file_and_line_or_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\n\nbro\xffken\n")
    with pytest.raises(InvalidRecord, match=rf"{path}:3: not valid UTF-8 \(byte 3 of the document\)"):
        list(RecordReader([path], split_on_blank_lines=True).texts())
    reader = RecordReader([path], split_on_blank_lines=True, skip_invalid=True)
    assert list(reader.texts()) == ["fine"] and reader.skipped == {"invalid UTF-8": 1}
    source = TextSource(DataSourceConfig(path=str(path), split_on_blank_lines=True), chunk_documents=8)
    docs = list(source.documents())
    assert docs[0] == "fine" and isinstance(docs[1], InvalidRecord) and f"{path}:3" in str(docs[1])
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(InvalidRecord, match=rf"{empty}:1: an empty document"):
        list(RecordReader([empty]).texts())


def test_a_directory_of_txt_files_but_not_txt_beside_records(tmp_path):
    (tmp_path / "d").mkdir()
    a, b = tmp_path / "d" / "a.txt", tmp_path / "d" / "b.txt"
    a.write_text("A")
    b.write_text("B")
    assert resolve_inputs([tmp_path / "d"]) == [a, b]
    (tmp_path / "d" / "c.jsonl").write_text('{"text": "C"}\n')
    with pytest.raises(ValueError, match=r"both \.txt documents .*a\.txt.* and records .*c\.jsonl"):
        resolve_inputs([tmp_path / "d"])
    assert list(RecordReader([tmp_path / "d" / "*.txt"]).texts()) == ["A", "B"]


def test_the_source_keys_are_documented_and_checked():
    configs = (REPO / "docs" / "configs.md").read_text()
    assert "split_on_blank_lines" in configs and "label_path" in configs
    with pytest.raises(ValueError, match="label_path"):
        DataConfig(sources=[DataSourceConfig(path="x.txt", label_path="y")])
