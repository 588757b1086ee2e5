"""The ground floor's writes: every output whole or not at all, an index never beside data it does not describe,
a link always pointing somewhere."""

from __future__ import annotations

import os

import pytest

from maester import files
from maester.files import AtomicOutputs, point_link, write_atomically


def test_a_failure_leaves_the_old_files_and_no_temporaries(tmp_path):
    write_atomically(tmp_path / "a", "old a")
    with pytest.raises(RuntimeError), AtomicOutputs() as out:
        out.temp_for(tmp_path / "a").write_text("new a")
        out.temp_for(tmp_path / "b").write_text("new b")
        raise RuntimeError("stopped")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] and (tmp_path / "a").read_text() == "old a"


def test_the_key_goes_first_and_comes_back_last(tmp_path, monkeypatch):
    """While the data is renamed into place there is no stale index beside it: the index is removed first and
    renamed last, whatever order the temporaries were made in."""
    for name in ("data.idx", "data.bin"):
        (tmp_path / name).write_text("old")
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append((os.path.basename(dst), sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))))
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with AtomicOutputs(key=tmp_path / "data.idx") as out:
        out.temp_for(tmp_path / "data.idx").write_text("new idx")
        out.temp_for(tmp_path / "data.bin").write_text("new bin")
    assert seen == [("data.bin", ["data.bin"]), ("data.idx", ["data.bin"])]
    assert (tmp_path / "data.idx").read_text() == "new idx" and (tmp_path / "data.bin").read_text() == "new bin"


def test_a_link_is_moved_in_one_rename(tmp_path, monkeypatch):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    point_link(tmp_path / "latest", "one")
    assert os.readlink(tmp_path / "latest") == "one"
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(files.os, "replace", lambda src, dst: (replaced.append(os.readlink(dst)),
                                                               real_replace(src, dst)))
    point_link(tmp_path / "latest", "two")
    assert replaced == ["one"]  # the old link stood until the rename
    assert os.readlink(tmp_path / "latest") == "two" and sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "one", "two"]
