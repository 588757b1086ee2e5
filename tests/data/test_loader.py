"""Raw text -> streams -> windows -> seeded, resumable, rank- and worker-independent batches; errors name the record."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from maester.config import DataConfig, DataSourceConfig, TokenizerConfig
from maester.data.batch import BatchPlan, documents_from_eos
from maester.data.loader import build_loader
from maester.data.records import InvalidDocument
from maester.data.text_files import TextSource, resolve_files
from maester.data.text_loader import TextLoader
from maester.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
TOK_CFG = TokenizerConfig(kind="byte")
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


def source(path, **kw) -> DataSourceConfig:
    return DataSourceConfig(path=str(path), **kw)


def data_cfg(*sources, seq_len: int = 16, num_workers: int = 0, chunk_documents: int = 4, **kw) -> DataConfig:
    sources = [s if isinstance(s, DataSourceConfig) else source(s) for s in sources]
    return DataConfig(sources=sources, seq_len=seq_len, num_workers=num_workers, chunk_documents=chunk_documents,
                      **kw)


def loader(cfg: DataConfig, *, seed: int = 0, global_batch: int = 4, micro_batch: int = 2, dp_rank: int = 0,
           dp_size: int = 1) -> TextLoader:
    return build_loader(cfg, TOK_CFG, TOK, seed=seed, batch=BatchPlan(global_batch, micro_batch, dp_size, dp_rank))


def step_rows(ld) -> torch.Tensor:
    """A step's windows (inputs plus the last label) as one (rows, seq_len + 1) tensor."""
    batches = ld.next_step()
    return torch.cat([torch.cat([b.input_ids, b.labels[:, -1:]], dim=1) for b in batches])


def numbered_docs(n: int, width: int = 0) -> list[str]:
    return [f"doc{i:05d}" + "x" * (width or (i * 7) % 23) for i in range(n)]


def stream_documents(rows: list[torch.Tensor]) -> list[str]:
    """Documents of one stream from its consecutive windows (they overlap by one token)."""
    tokens = torch.cat([rows[0]] + [r[1:] for r in rows[1:]]).tolist()
    text = bytes(t if t < 256 else 0 for t in tokens).decode()
    return [d for d in text.split("\x00")]


# ---------------------------------------------------------------- the stream


def test_windows_join_documents_with_eos_and_every_token_is_a_label_once(tmp_path):
    docs = numbered_docs(40)
    path = write_parquet(tmp_path / "d.parquet", docs)
    ld = loader(data_cfg(path, add_bos=True), global_batch=1, micro_batch=1)
    rows = [step_rows(ld)[0] for _ in range(30)]
    for a, b in zip(rows, rows[1:]):
        assert a[-1] == b[0]  # stride seq_len: the last label is the next window's first input
    batch = ld.next_step()[0]
    assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])
    seen = stream_documents(rows)
    # [BOS] doc EOS: every complete document in the stream is one of ours, whole, and none repeats
    whole = [d for d in seen[1:-1]]
    assert all(d.startswith(chr(0) if False else "") for d in whole)
    texts = [bytes(t for t in d.encode() if t != BOS).decode() if False else d for d in whole]
    tokens = torch.cat([rows[0]] + [r[1:] for r in rows[1:]]).tolist()
    split = []
    cur: list[int] = []
    for t in tokens:
        if t == EOS:
            split.append(cur)
            cur = []
        else:
            cur.append(t)
    complete = split[:-1] if cur == [] else split
    assert all(d[0] == BOS for d in complete)
    texts = [bytes(d[1:]).decode() for d in complete]
    assert len(texts) == len(set(texts)) and set(texts) <= set(docs)
    assert len(texts) > 20


def test_order_depends_on_the_seed_only(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", numbered_docs(64))
    a = [step_rows(loader(data_cfg(path), seed=1)) for _ in range(1)][0]
    b = [step_rows(loader(data_cfg(path), seed=1)) for _ in range(1)][0]
    c = [step_rows(loader(data_cfg(path), seed=2)) for _ in range(1)][0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_mixing_follows_the_weights_within_two_percent_over_a_million_tokens(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    sources = []
    for name, w in weights.items():  # documents of one letter each, of very different lengths per source
        mean = {"a": 60, "b": 400, "c": 1500}[name]
        lengths = rng.integers(1, 2 * mean, size=400)
        write_parquet(tmp_path / name / "part.parquet", [name * int(n) for n in lengths])
        sources.append(source(tmp_path / name, weight=w * 10))
    cfg = data_cfg(*sources, seq_len=512, chunk_documents=64)
    ld = loader(cfg, global_batch=16, micro_batch=16)
    counts: Counter = Counter()
    total = 0
    while total < 1_000_000:
        (batch,) = ld.next_step()
        values, n = torch.unique(batch.input_ids, return_counts=True)
        counts.update(dict(zip(values.tolist(), n.tolist())))
        total += batch.input_ids.numel()
    letters = {name: counts[ord(name)] for name in weights}
    text_tokens = sum(letters.values())
    for name, w in weights.items():
        assert abs(letters[name] / text_tokens - w) < 0.02, (name, letters[name] / text_tokens)
    metrics = ld.source_metrics()
    assert sum(m["tokens"] for m in metrics.values()) == total
    for name, w in weights.items():
        assert abs(metrics[name]["tokens"] / total - w) < 0.02


@pytest.mark.parametrize("num_workers", [1, 3])
def test_worker_count_does_not_change_the_stream(tmp_path, num_workers):
    path = write_parquet(tmp_path / "d.parquet", numbered_docs(120))
    reference = loader(data_cfg(path, num_workers=0), global_batch=6, micro_batch=3)
    workers = loader(data_cfg(path, num_workers=num_workers), global_batch=6, micro_batch=3)
    try:
        for _ in range(12):
            assert torch.equal(step_rows(reference), step_rows(workers))
        assert workers.state_dict() == reference.state_dict()
    finally:
        workers.close()


@pytest.mark.parametrize("stop", [1, 5, 13])
def test_resume_at_any_step_equals_the_uninterrupted_stream(tmp_path, stop):
    path = write_parquet(tmp_path / "d.parquet", numbered_docs(50))
    cfg = data_cfg(path, document_masking=True)
    whole = loader(cfg)
    expected = [step_rows(whole) for _ in range(stop + 8)]
    first = loader(cfg)
    for _ in range(stop):
        step_rows(first)
    state = json.loads(json.dumps(first.state_dict()))  # as it travels through the checkpoint
    resumed = loader(cfg)
    resumed.load_state_dict(state)
    for k in range(stop, stop + 8):
        assert torch.equal(step_rows(resumed), expected[k])


def merged_state(loaders) -> dict:
    states = [ld.state_dict() for ld in loaders]
    return {**states[0], "states": {k: v for s in states for k, v in s["states"].items()}}


def test_four_ranks_resume_on_two_and_cover_every_document_once_per_epoch(tmp_path):
    # 64 documents of one length, 4 per chunk, 8 streams: every stream reads 2 chunks per epoch in lockstep.
    docs = numbered_docs(64, width=7)  # 15 characters + EOS = 16 tokens each
    path = write_parquet(tmp_path / "d.parquet", docs)
    cfg = data_cfg(path, seq_len=16)
    single = loader(cfg, global_batch=8, micro_batch=1)
    expected = [step_rows(single) for _ in range(16)]
    four = [loader(cfg, global_batch=8, micro_batch=1, dp_rank=r, dp_size=4) for r in range(4)]
    got = [torch.cat([step_rows(ld) for ld in four]) for _ in range(5)]
    two = [loader(cfg, global_batch=8, micro_batch=2, dp_rank=r, dp_size=2) for r in range(2)]
    for ld in two:
        ld.load_state_dict(merged_state(four))
    got += [torch.cat([step_rows(ld) for ld in two]) for _ in range(11)]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # one epoch is 64 x 16 tokens = 8 streams x 8 windows of 16: steps 0-7 hold each document once, so do 8-15
    for steps in (range(8), range(8, 16)):
        seen = [d for s in range(8) for d in stream_documents([got[k][s] for k in steps]) if len(d) == 15]
        assert sorted(seen) == sorted(docs)


def test_resume_refuses_other_data_seed_or_batch(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", numbered_docs(30))
    other = write_parquet(tmp_path / "e.parquet", numbered_docs(31))
    ld = loader(data_cfg(path))
    step_rows(ld)
    state = ld.state_dict()
    with pytest.raises(ValueError, match="different data or another seed"):
        loader(data_cfg(other)).load_state_dict(state)
    with pytest.raises(ValueError, match="different data or another seed"):
        loader(data_cfg(path), seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="global batch of 4 sequences, now 8"):
        loader(data_cfg(path), global_batch=8).load_state_dict(state)


def test_rank_split_must_divide(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", numbered_docs(30))
    with pytest.raises(ValueError, match="does not split"):
        loader(data_cfg(path), global_batch=6, micro_batch=2, dp_size=4)


def test_document_masking_restarts_positions_after_each_eos(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ["ab", "cde", "fghij"] * 10)
    ld = loader(data_cfg(path, seq_len=12, document_masking=True), global_batch=1, micro_batch=1)
    (batch,) = ld.next_step()
    ids, docs, pos = batch.input_ids[0].tolist(), batch.document_ids[0].tolist(), batch.position_ids[0].tolist()
    for i in range(1, len(ids)):
        if ids[i - 1] == EOS:
            assert docs[i] == docs[i - 1] + 1 and pos[i] == 0
        else:
            assert docs[i] == docs[i - 1] and pos[i] == pos[i - 1] + 1


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



# ---------------------------------------------------------------- validation split


def ids_in(rows: torch.Tensor) -> list[str]:
    """Document numbers in consecutive input rows of one stream."""
    text = bytes(t if t < 256 else 32 for t in rows.flatten().tolist()).decode()
    return re.findall(r"doc(\d{5})", text)


def test_validation_split_is_fixed_and_never_trained_on(tmp_path):
    docs = numbered_docs(400, width=3)
    path = write_parquet(tmp_path / "d.parquet", docs)
    cfg = data_cfg(source(path, validation_fraction=0.1), seq_len=9)
    held = []
    for seed in (0, 1):
        ld = loader(cfg, seed=seed, global_batch=4, micro_batch=4)
        steps = [ld.next_step()[0].input_ids for _ in range(200)]  # past one epoch of the training part
        trained = {d for r in range(4) for d in ids_in(torch.stack([x[r] for x in steps]))}
        val = torch.cat([b.input_ids for b in ld.validation_batches(micro_batch=3)])
        validation = set(ids_in(val))
        assert 20 < len(validation) < 70  # about 10% of 400
        assert not trained & validation
        assert len(trained | validation) >= 399  # the validation stream drops its last partial window
        held.append(validation)
    assert held[0] == held[1]  # the same documents whatever the seed


# ---------------------------------------------------------------- files and errors


def test_resolve_files_directory_and_glob_sorted(tmp_path):
    root = tmp_path / "corpus"
    b = write_jsonl(root / "b.jsonl", [{"text": "b"}])
    a = write_parquet(root / "a.parquet", ["a"])
    c = write_jsonl(root / "sub" / "c.json", [{"text": "c"}])
    d = write_parquet(root / "sub" / "deeper" / "d.parquet", ["d"])
    (root / "README.md").write_text("not data")
    (root / "sub" / "notes.md").write_text("not data")
    assert resolve_files(DataSourceConfig(path=str(root))) == [a, b, c, d]
    assert resolve_files(DataSourceConfig(path=str(root / "*.jsonl"))) == [b]
    assert resolve_files(DataSourceConfig(path=str(root / "**" / "*.parquet"))) == [a, d]
    assert resolve_files(DataSourceConfig(path=str(root / "?.*[lt]"))) == [a, b]
    assert resolve_files(DataSourceConfig(path=str(a))) == [a]
    # A glob that catches a file whose format cannot be told is an error naming it.
    with pytest.raises(ValueError, match="README.md"):
        resolve_files(DataSourceConfig(path=str(root / "*")))
    # ... unless the format is given.
    assert resolve_files(DataSourceConfig(path=str(root / "sub" / "*.md"), format="jsonl")) == [root / "sub" / "notes.md"]



def test_missing_sources_are_errors_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_dir: no such file or directory"):
        loader(data_cfg(tmp_path / "no_such_dir"))
    with pytest.raises(FileNotFoundError, match=r"nothing_here_\*\.parquet.*matches no"):
        loader(data_cfg(tmp_path / "nothing_here_*.parquet"))


def test_parquet_without_the_text_column_names_the_file(tmp_path):
    path = write_parquet(tmp_path / "cols.parquet", ["a", "b"], column="body")
    with pytest.raises(ValueError, match="no column 'text'") as err:
        loader(data_cfg(path))
    assert str(path) in str(err.value) and "body" in str(err.value)


def first_error(cfg: DataConfig) -> str:
    ld = loader(cfg, global_batch=1, micro_batch=1)
    with pytest.raises(InvalidDocument) as err:
        for _ in range(200):
            ld.next_step()
    return str(err.value)


def test_parquet_bad_rows_name_file_and_row(tmp_path):
    texts = [f"row {i}" for i in range(2500)]
    texts[2345] = None
    texts[1500] = ""
    path = write_parquet(tmp_path / "bad.parquet", texts, row_group_size=1000)
    src = TextSource(source(path), 1024)
    records = list(src.documents())
    assert isinstance(records[2345], InvalidDocument) and f"{path}: row 2345" in str(records[2345])
    assert "null, not text" in str(records[2345])
    assert "empty document" in str(records[1500]) and "row 1500" in str(records[1500])
    assert re.search(re.escape(str(path)) + r": row (2345|1500)", first_error(data_cfg(path, chunk_documents=2500)))


def test_parquet_non_string_column_is_an_error(tmp_path):
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    assert "row 0: field 'text' holds int, not text" in first_error(data_cfg(path))


def test_unreadable_parquet_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match="broken.parquet: not a readable Parquet file"):
        loader(data_cfg(path))


@pytest.mark.parametrize("line,problem", [
    ("{not json", "malformed JSON"),
    ('{"body": "x"}', "no field 'text'"),
    ('["text"]', "a JSON list, not an object"),
    ('{"text": null}', "holds null, not text"),
    ('{"text": 3}', "holds int, not text"),
    ('{"text": ""}', "empty document"),
    ("", "blank line"),
])
def test_jsonl_bad_records_name_file_and_line(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "rec.jsonl", [{"text": "ok"}, line, {"text": "fine"}])
    records = list(TextSource(source(path), 2).documents())
    assert records[0] == "ok" and records[2] == "fine"
    assert str(records[1]).startswith(f"{path}:2: ") and problem in str(records[1])
    assert f"{path}:2: " in first_error(data_cfg(path, chunk_documents=8))


def test_jsonl_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    records = list(TextSource(source(path), 8).documents())
    assert records[0] == "ok" and f"{path}:2: not valid UTF-8" in str(records[1])


def test_skip_invalid_skips_and_counts_per_source(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": f"good {i}"} for i in range(20)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "b1"}, "{oops", {"text": ""}, {"text": "b2"}, {"x": 1}])
    cfg = data_cfg(good, bad, skip_invalid=True, chunk_documents=8)
    ld = loader(cfg, global_batch=2, micro_batch=2)
    seen = []
    for _ in range(40):
        (batch,) = ld.next_step()
        seen.append(batch.input_ids)
    metrics = ld.source_metrics()
    bad_counts = metrics["bad.jsonl"]
    # 3 invalid records for every 2 valid ones, up to the partly read epoch of each of the 2 streams
    assert bad_counts["skipped"] > 0 and abs(bad_counts["skipped"] - 1.5 * bad_counts["documents"]) <= 6
    assert metrics["good.jsonl"]["skipped"] == 0
    text = bytes(t if t < 256 else 10 for t in torch.cat(seen).flatten().tolist()).decode()
    assert "b1" in text and "b2" in text and "oops" not in text


def test_jsonl_and_parquet_give_the_same_stream(tmp_path):
    docs = numbered_docs(30)
    a = loader(data_cfg(write_parquet(tmp_path / "p" / "d.parquet", docs)))
    b = loader(data_cfg(write_jsonl(tmp_path / "j" / "d.jsonl", [{"text": d} for d in docs])))
    for _ in range(6):
        assert torch.equal(step_rows(a), step_rows(b))


def test_the_data_directory_is_only_read(tmp_path):
    root = tmp_path / "data"
    write_parquet(root / "a.parquet", numbered_docs(40))
    write_jsonl(root / "b.jsonl", [{"text": d} for d in numbered_docs(40)])
    def snapshot():
        return sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*"))
    before = snapshot()
    for p in root.rglob("*"):
        p.chmod(0o444 if p.is_file() else 0o555)
    root.chmod(0o555)
    try:
        ld = loader(data_cfg(root, num_workers=1))
        for _ in range(10):
            ld.next_step()
        ld.state_dict()
        ld.close()
    finally:
        root.chmod(0o755)
    assert snapshot() == before
