"""Text files -> token stream -> windows -> seeded, resumable, rank-splittable batches; errors name the record."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from maester.config import DataConfig, DataSourceConfig
from maester.data.loader import (IGNORE_INDEX, TokenWindows, WindowLoader, build_loader, documents_from_eos,
                                 tokenize_documents)
from maester.data.text_files import read_documents, resolve_files
from maester.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
BOS, EOS = TOK.bos_id, TOK.eos_id


def write_parquet(path: Path, texts: list, column: str = "text", **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: pa.array(texts, type=pa.string()), "id": list(range(len(texts)))}),
                   path, **kwargs)
    return path


def write_jsonl(path: Path, lines: list) -> Path:
    """`lines`: dicts are written as JSON, strings verbatim."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines),
                    encoding="utf-8")
    return path


def data_cfg(*paths, seq_len: int = 8, **kwargs) -> DataConfig:
    return DataConfig(sources=[DataSourceConfig(path=str(p)) for p in paths], seq_len=seq_len, **kwargs)


def expected_stream(docs: list[str], add_bos: bool) -> list[int]:
    out = []
    for d in docs:
        out += ([BOS] if add_bos else []) + list(d.encode("utf-8")) + [EOS]
    return out


# ---------------------------------------------------------------- tokenize_documents


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenize_documents_joins_sources_in_order_with_eos(tmp_path, add_bos):
    pq_docs = ["first doc", "zweites Dokument: ü", "third"]
    js_docs = ["fourth from jsonl", "fünfte 🚀"]
    parquet = write_parquet(tmp_path / "a.parquet", pq_docs)
    jsonl = write_jsonl(tmp_path / "b.jsonl", [{"text": d, "meta": i} for i, d in enumerate(js_docs)])
    tokens = tokenize_documents(data_cfg(parquet, jsonl, add_bos=add_bos), TOK)
    assert tokens.dtype == np.uint16  # 259 ids fit 16 bits
    assert tokens.tolist() == expected_stream(pq_docs + js_docs, add_bos)
    assert (tokens == EOS).sum() == 5
    assert (tokens == BOS).sum() == (5 if add_bos else 0)


def test_tokenize_documents_batches_do_not_change_the_stream(tmp_path):
    docs = [f"document number {i}" for i in range(23)]
    path = write_parquet(tmp_path / "d.parquet", docs)
    whole = tokenize_documents(data_cfg(path), TOK)
    small = tokenize_documents(data_cfg(path), TOK, batch_docs=4)
    assert np.array_equal(whole, small)
    assert whole.tolist() == expected_stream(docs, add_bos=False)


def test_tokenize_documents_text_column_and_empty_data(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", ["abc", "de"], column="content")
    cfg = DataConfig(sources=[DataSourceConfig(path=str(path), text_column="content")], seq_len=4)
    assert tokenize_documents(cfg, TOK).tolist() == expected_stream(["abc", "de"], add_bos=False)
    empty = write_parquet(tmp_path / "empty.parquet", [])
    with pytest.raises(ValueError, match="no documents"):
        tokenize_documents(data_cfg(empty), TOK)


# ---------------------------------------------------------------- windows


def test_windows_have_seq_len_plus_one_tokens_and_every_label_once():
    seq_len = 7
    tokens = np.arange(100, dtype=np.int64)
    windows = TokenWindows(tokens, seq_len)
    assert len(windows) == (100 - 1) // seq_len == 14
    labels = []
    for i in range(len(windows)):
        w = windows[i]
        assert len(w) == seq_len + 1
        assert w[0] == i * seq_len  # stride seq_len: the last token of a window is the first of the next
        assert np.array_equal(w, np.arange(i * seq_len, i * seq_len + seq_len + 1))
        labels += w[1:].tolist()
    assert labels == list(range(1, len(windows) * seq_len + 1))  # each label exactly once, none skipped
    # Exactly one window: seq_len + 1 tokens; fewer is an error.
    assert len(TokenWindows(np.arange(8), 7)) == 1
    with pytest.raises(ValueError, match="fewer than one sequence"):
        TokenWindows(np.arange(7), 7)


def make_loader(n_windows: int = 10, seq_len: int = 4, *, seed: int = 0, global_batch: int = 4,
                micro_batch: int = 2, dp_rank: int = 0, dp_size: int = 1, tokens=None, **kw) -> WindowLoader:
    if tokens is None:
        tokens = np.arange(n_windows * seq_len + 1, dtype=np.int64)
    return WindowLoader(TokenWindows(tokens, seq_len), seed=seed, global_batch=global_batch,
                        micro_batch=micro_batch, eos_id=EOS, dp_rank=dp_rank, dp_size=dp_size, **kw)


def step_windows(loader: WindowLoader) -> list[int]:
    """The window indices of one step's samples on this rank (tokens are positions: window = first // seq_len)."""
    seq_len = loader.windows.seq_len
    out = []
    for batch in loader.next_step():
        assert batch.input_ids.dtype == torch.int64 and batch.labels.dtype == torch.int64
        assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == \
            (loader.micro_batch, seq_len)
        out += (batch.input_ids[:, 0] // seq_len).tolist()
    return out


def test_batches_are_shifted_windows():
    loader = make_loader(n_windows=10, seq_len=4, global_batch=4, micro_batch=2)
    assert loader.accumulation_steps == 2
    batches = loader.next_step()
    assert len(batches) == 2
    for b in batches:
        assert torch.equal(b.labels, b.input_ids + 1)  # labels are the next tokens
        assert torch.equal(b.input_ids[:, 0] % 4, torch.zeros(2, dtype=torch.long))
        assert torch.equal(b.position_ids, torch.arange(4).expand(2, 4))
        assert b.document_ids is None
        assert b.num_tokens == 8
        assert not (b.labels == IGNORE_INDEX).any()


def test_order_is_a_function_of_the_seed():
    def run(seed):
        loader = make_loader(n_windows=50, seed=seed, global_batch=5, micro_batch=5)
        return [step_windows(loader) for _ in range(10)]

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert run(3) != [list(range(i * 5, i * 5 + 5)) for i in range(10)]  # shuffled, not sequential


def test_each_epoch_visits_every_window_once_and_epochs_wrap():
    n = 10
    loader = make_loader(n_windows=n, global_batch=4, micro_batch=2)
    seen = []
    for _ in range(10):  # 40 samples = 4 epochs; steps straddle epoch boundaries (10 is not a multiple of 4)
        seen += step_windows(loader)
    assert loader.samples_consumed == 40 and loader.epoch == 4
    epochs = [seen[i:i + n] for i in range(0, 40, n)]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert len({tuple(e) for e in epochs}) > 1  # each epoch is reshuffled
    # The epoch counter follows the samples consumed.
    loader2 = make_loader(n_windows=n, global_batch=4, micro_batch=2)
    epochs_at_step = []
    for _ in range(5):
        loader2.next_step()
        epochs_at_step.append(loader2.epoch)
    assert epochs_at_step == [0, 0, 1, 1, 2]


def test_one_epoch_takes_every_token_after_the_first_as_a_label_once(tmp_path):
    docs = [f"doc {i} " + "x" * (i % 7) for i in range(40)]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    seq_len = 9
    cfg = data_cfg(path, seq_len=seq_len)
    loader = build_loader(cfg, TOK, seed=1, global_batch=2, micro_batch=1)
    stream = tokenize_documents(cfg, TOK).astype(np.int64)
    n = len(loader.windows)
    assert n == (len(stream) - 1) // seq_len
    assert n % 2 == 1  # the last step of the epoch spills into the next one
    rows = []
    while len(rows) < n:
        for batch in loader.next_step():
            assert torch.equal(batch.input_ids[0, 1:], batch.labels[0, :-1])
            rows.append(tuple(batch.input_ids[0].tolist()) + (int(batch.labels[0, -1]),))
    rows = rows[:n]
    expected = [tuple(stream[i * seq_len:(i + 1) * seq_len + 1].tolist()) for i in range(n)]
    assert sorted(rows) == sorted(expected)  # every window once in the epoch
    labels = [t for row in rows for t in row[1:]]
    assert sorted(labels) == sorted(stream[1:n * seq_len + 1].tolist())
    assert len(stream) - 1 - n * seq_len < seq_len  # only a tail shorter than one sequence is left out


def test_resume_from_state_dict_gives_the_same_batches():
    reference = make_loader(n_windows=13, seed=7, global_batch=4, micro_batch=2)
    ref_batches = [reference.next_step() for _ in range(9)]

    first = make_loader(n_windows=13, seed=7, global_batch=4, micro_batch=2)
    for _ in range(4):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    assert state["samples_consumed"] == 16

    resumed = make_loader(n_windows=13, seed=7, global_batch=4, micro_batch=2)
    resumed.load_state_dict(state)
    for step in range(4, 9):
        for got, want in zip(resumed.next_step(), ref_batches[step], strict=True):
            assert torch.equal(got.input_ids, want.input_ids)
            assert torch.equal(got.labels, want.labels)
            assert torch.equal(got.position_ids, want.position_ids)


def all_ranks_step(loaders: list[WindowLoader]) -> list[int]:
    out = []
    for loader in loaders:  # rank order
        out += step_windows(loader)
    return out


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_resume_on_another_dp_size_neither_repeats_nor_skips(before, after):
    kw = dict(n_windows=11, seed=5, global_batch=8, micro_batch=2)
    single = make_loader(**kw)
    reference = [step_windows(single) for _ in range(7)]  # 56 samples: 5+ epochs, crossing boundaries

    ranks = [make_loader(**kw, dp_rank=r, dp_size=before) for r in range(before)]
    got = [all_ranks_step(ranks) for _ in range(3)]
    states = [r.state_dict() for r in ranks]
    assert all(s == states[0] for s in states)  # every rank holds the same (global) position
    ranks = [make_loader(**kw, dp_rank=r, dp_size=after) for r in range(after)]
    for r in ranks:
        r.load_state_dict(states[0])
        assert r.accumulation_steps == 8 // after // 2
    got += [all_ranks_step(ranks) for _ in range(4)]
    # At every step the ranks' samples, in rank order, are exactly the single-rank batch.
    assert got == reference


def test_loading_a_state_of_other_data_or_seed_raises():
    loader = make_loader(n_windows=10, seed=0)
    loader.next_step()
    state = loader.state_dict()

    other_tokens = np.arange(41, dtype=np.int64)
    other_tokens[17] = 3
    for other in (make_loader(tokens=other_tokens, seed=0),  # same length, one token differs
                  make_loader(n_windows=11, seed=0),  # more data
                  make_loader(n_windows=10, seq_len=4, seed=1),  # another seed
                  make_loader(tokens=np.arange(41, dtype=np.int64), seq_len=5, seed=0)):  # another seq_len
        with pytest.raises(ValueError, match="different data or another seed"):
            other.load_state_dict(state)
        assert other.samples_consumed == 0
    same = make_loader(n_windows=10, seed=0)
    same.load_state_dict(state)
    assert same.samples_consumed == 4


def test_rank_split_must_divide():
    with pytest.raises(ValueError, match="does not split"):
        make_loader(global_batch=6, micro_batch=2, dp_size=4)
    with pytest.raises(ValueError, match="does not split"):
        make_loader(global_batch=6, micro_batch=4, dp_size=1)


# ---------------------------------------------------------------- document masking


def test_documents_from_eos_hand_written():
    E = 9
    inputs = torch.tensor([
        [5, E, 6, 7, E, 8],
        [E, E, 1, 2, 3, E],
        [1, 2, 3, 4, 5, 6],
    ])
    document_ids, position_ids = documents_from_eos(inputs, E)
    assert torch.equal(document_ids, torch.tensor([
        [0, 0, 1, 1, 1, 2],
        [0, 1, 2, 2, 2, 2],
        [0, 0, 0, 0, 0, 0],
    ]))
    assert torch.equal(position_ids, torch.tensor([
        [0, 1, 0, 1, 2, 0],
        [0, 0, 0, 1, 2, 3],
        [0, 1, 2, 3, 4, 5],
    ]))


def test_loader_with_document_masking_sets_documents_and_positions():
    #            doc 0     doc 1          doc 2
    stream = np.array([1, 2, EOS, 3, 4, 5, EOS, 6, 7, 8, 9, 10, EOS], dtype=np.int64)
    windows = TokenWindows(stream, 6)  # windows [0:7] and [6:13]
    loader = WindowLoader(windows, seed=0, global_batch=2, micro_batch=2, eos_id=EOS, document_masking=True)
    (batch,) = loader.next_step()
    order = batch.input_ids[:, 0].tolist()
    rows = {1: 0, EOS: 1}  # window 0 starts with token 1, window 1 with the EOS at index 6
    assert sorted(order) == sorted(rows)
    expected = {
        1: ([1, 2, EOS, 3, 4, 5], [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]),
        EOS: ([EOS, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1, 1], [0, 0, 1, 2, 3, 4]),
    }
    for row, first in enumerate(order):
        ids, docs, pos = expected[first]
        assert batch.input_ids[row].tolist() == ids
        assert batch.document_ids[row].tolist() == docs
        assert batch.position_ids[row].tolist() == pos


# ---------------------------------------------------------------- files and errors


def test_resolve_files_directory_and_glob_sorted(tmp_path):
    root = tmp_path / "corpus"
    b = write_jsonl(root / "b.jsonl", [{"text": "b"}])
    a = write_parquet(root / "a.parquet", ["a"])
    c = write_jsonl(root / "sub" / "c.json", [{"text": "c"}])
    d = write_parquet(root / "sub" / "deeper" / "d.parquet", ["d"])
    (root / "README.txt").write_text("not data")
    (root / "sub" / "notes.md").write_text("not data")
    assert resolve_files(DataSourceConfig(path=str(root))) == [a, b, c, d]
    assert resolve_files(DataSourceConfig(path=str(root / "*.jsonl"))) == [b]
    assert resolve_files(DataSourceConfig(path=str(root / "**" / "*.parquet"))) == [a, d]
    assert resolve_files(DataSourceConfig(path=str(root / "?.*[lt]"))) == [a, b]
    assert resolve_files(DataSourceConfig(path=str(a))) == [a]
    # A glob that catches a file whose format cannot be told is an error naming it.
    with pytest.raises(ValueError, match="README.txt"):
        resolve_files(DataSourceConfig(path=str(root / "*")))
    # ... unless the format is given.
    assert resolve_files(DataSourceConfig(path=str(root / "sub" / "*.md"), format="jsonl")) == [root / "sub" / "notes.md"]


def test_resolve_files_glob_is_sorted_regardless_of_creation_order(tmp_path):
    names = ["m.jsonl", "c.jsonl", "x.jsonl", "a.jsonl"]
    for name in names:
        write_jsonl(tmp_path / name, [{"text": name}])
    files = resolve_files(DataSourceConfig(path=str(tmp_path / "*.jsonl")))
    assert [f.name for f in files] == sorted(names)
    cfg = data_cfg(tmp_path / "*.jsonl")
    assert tokenize_documents(cfg, TOK).tolist() == expected_stream(sorted(names), add_bos=False)


def test_missing_sources_are_errors_naming_the_path(tmp_path):
    missing_dir = tmp_path / "no_such_dir"
    with pytest.raises(FileNotFoundError, match="no_such_dir.*does not exist"):
        resolve_files(DataSourceConfig(path=str(missing_dir)))
    with pytest.raises(FileNotFoundError, match=r"nothing_here_\*\.parquet.*matches no"):
        resolve_files(DataSourceConfig(path=str(tmp_path / "nothing_here_*.parquet")))
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "emptydir" / "x.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="emptydir.*matches no"):
        resolve_files(DataSourceConfig(path=str(tmp_path / "emptydir")))
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        tokenize_documents(data_cfg(missing_dir), TOK)


def test_parquet_without_the_text_column_names_the_file(tmp_path):
    path = write_parquet(tmp_path / "cols.parquet", ["a", "b"], column="body")
    with pytest.raises(ValueError, match="no column 'text'") as err:
        tokenize_documents(data_cfg(path), TOK)
    assert str(path) in str(err.value)
    assert "body" in str(err.value)  # lists the columns there are


def test_parquet_null_text_names_the_file_and_row(tmp_path):
    texts = [f"row {i}" for i in range(2500)]
    texts[2345] = None
    # Several row groups and read batches: the row number counts over all of them.
    path = write_parquet(tmp_path / "nulls.parquet", texts, row_group_size=1000)
    assert pq.ParquetFile(path).num_row_groups == 3
    with pytest.raises(ValueError, match="row 2345") as err:
        list(read_documents(path, DataSourceConfig(path=str(path))))
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match=re.escape(f"{path}: row 2345")):
        tokenize_documents(data_cfg(path), TOK)


def test_parquet_non_string_column_is_an_error(tmp_path):
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    with pytest.raises(ValueError, match="row 0.*int"):
        tokenize_documents(data_cfg(path), TOK)


def test_unreadable_parquet_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match="broken.parquet: not a readable Parquet file"):
        tokenize_documents(data_cfg(path), TOK)


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "one"}, "", {"text": "three"}, "{not json", {"text": "5"}])
    with pytest.raises(ValueError, match=re.escape(f"{path}:4: not valid JSON")):
        tokenize_documents(data_cfg(path), TOK)


@pytest.mark.parametrize("line,problem", [
    ('{"body": "x"}', "no field 'text'"),
    ('["text"]', "no field 'text'"),
    ('{"text": null}', "holds NoneType, not text"),
    ('{"text": 3}', "holds int, not text"),
])
def test_jsonl_bad_records_name_file_and_line(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "rec.jsonl", [{"text": "ok"}, line])
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(problem)):
        list(read_documents(path, DataSourceConfig(path=str(path))))


def test_jsonl_blank_lines_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "blank.jsonl", [{"text": "a"}, "", "   ", {"text": "b"}])
    assert list(read_documents(path, DataSourceConfig(path=str(path)))) == ["a", "b"]


def test_fingerprint_sees_a_change_anywhere_in_the_stream():
    import numpy as np

    from maester.data.loader import TokenWindows

    tokens = np.arange(3_000_000, dtype=np.uint32) % 250
    changed = tokens.copy()
    changed[1_500_000] += 1  # the middle, far from both ends
    assert TokenWindows(tokens, 16).fingerprint() != TokenWindows(changed, 16).fingerprint()
    assert TokenWindows(tokens, 16).fingerprint() == TokenWindows(tokens.copy(), 16).fingerprint()
