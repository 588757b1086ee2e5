"""`maester data pack`: conversations to packed Parquet rows, checked against the chat encoder itself."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from maester.config import SFTConfig
from maester.data.chat import ChatEncoder
from maester.data.batch import IGNORE_INDEX
from maester.data.packing import fit_length
from tests.helpers import REPO, WORDS, clean_env, run_maester
from tests.tools.test_data_commands import BYTE, data, summary_of, write_jsonl

COLUMNS = ("input_ids", "labels", "position_ids", "document_ids", "seq_lens")


def make_conversations(n: int, seed: int = 0, long_every: int = 0) -> list[dict]:
    """Conversations of 1-3 user/assistant exchanges; every `long_every`-th one far longer than the rest."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k)))

    out = []
    for i in range(n):
        k = 120 if long_every and i % long_every == 0 else 12
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": text(k)}, {"role": "assistant", "content": text(k)}]
        out.append({"messages": messages, "id": i})
    return out


def expected_examples(conversations: list[dict], seq_len: int, overlong: str) -> tuple[list, Counter]:
    """What the packer should keep: each conversation through the chat encoder, then fitted to `seq_len`."""
    encoder = ChatEncoder(BYTE, SFTConfig(template="chatml", mask="assistant_only"))
    kept, counts = [], Counter()
    for c in conversations:
        encoded = encoder.encode(c["messages"])
        fitted = fit_length(encoded.tokens, encoded.labels(), seq_len, overlong)
        if fitted is None:
            counts["dropped"] += 1
            continue
        counts["truncated"] += len(fitted[0]) < len(encoded.tokens)
        kept.append((tuple(fitted[0].tolist()), tuple(fitted[1].tolist())))
    return kept, counts


def read_rows(directory: Path) -> tuple[dict[str, list], dict[bytes, bytes]]:
    files = sorted(directory.glob("part-*.parquet"))
    assert files and [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(len(files))]
    tables = [pq.read_table(f) for f in files]
    for table in tables:
        assert table.schema.names == list(COLUMNS)
        assert all(table.schema.field(c).type == pa.list_(pa.int32()) for c in COLUMNS)
    rows = {c: [row for t in tables for row in t.column(c).to_pylist()] for c in COLUMNS}
    return rows, tables[0].schema.metadata


def conversations_in(rows: dict[str, list], seq_len: int, pad_id: int) -> list[tuple[tuple, tuple]]:
    """Every conversation of every row, as (tokens, labels), after checking the row's layout."""
    found = []
    for ids, labels, positions, docs, lens in zip(*(rows[c] for c in COLUMNS)):
        assert len(ids) == len(labels) == len(positions) == len(docs) == seq_len
        start = 0
        for d, n in enumerate(lens):
            assert docs[start:start + n] == [d] * n
            assert positions[start:start + n] == list(range(n))
            found.append((tuple(ids[start:start + n]), tuple(labels[start:start + n])))
            start += n
        assert docs[start:] == [-1] * (seq_len - start)  # padding
        assert ids[start:] == [pad_id] * (seq_len - start)
        assert labels[start:] == [IGNORE_INDEX] * (seq_len - start) and positions[start:] == [0] * (seq_len - start)
    return found


def test_pack_through_the_installed_command_keeps_every_conversation_whole(tmp_path):
    conversations = make_conversations(150, long_every=10)
    source = write_jsonl(tmp_path / "chat.jsonl", conversations)
    seq_len = 384
    result = run_maester(["data", "pack", str(source), "--output", str(tmp_path / "packed"), "--seq-len",
                          str(seq_len), "--tokenizer", "byte", "--template", "chatml", "--mask", "assistant_only",
                          "--seed", "7", "--rows-per-file", "20"], cwd=REPO, env=clean_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    rows, meta = read_rows(tmp_path / "packed")
    expected, counts = expected_examples(conversations, seq_len, "truncate")
    assert counts["truncated"] > 0  # the long ones were cut
    found = conversations_in(rows, seq_len, pad_id=BYTE.pad_id)
    assert Counter(found) == Counter(expected)  # each conversation whole, in exactly one row
    untrained = sum(all(lab == IGNORE_INDEX for lab in labels) for _, labels in expected)
    assert untrained > 0  # truncation cut some before their first assistant token

    assert meta[b"seq_len"] == str(seq_len).encode() and meta[b"pad_id"] == str(BYTE.pad_id).encode()
    assert meta[b"template"] == b"chatml" and meta[b"mask"] == b"assistant_only"
    assert json.loads(meta[b"tokenizer"])["kind"] == "byte"
    assert json.loads(meta[b"sft"])["template"] == "chatml"

    fields = summary_of(result.stdout, "pack")
    tokens = sum(len(t) for t, _ in expected)
    n_rows = len(rows["input_ids"])
    assert fields["documents"] == "150" and fields["kept"] == "150" and fields["dropped"] == "0"
    assert fields["truncated"] == str(counts["truncated"]) and fields["skipped"] == "0"
    assert fields["untrained"] == str(untrained)
    assert fields["tokens"] == str(tokens) and fields["rows"] == str(n_rows)
    assert fields["efficiency"] == f"{tokens / (n_rows * seq_len):.2%}"
    assert float(fields["tokens/s"]) > 0 and fields["pack_time"].endswith("s")
    assert fields["files"] == str(-(-n_rows // 20)) == str(len(list((tmp_path / "packed").iterdir())))


def test_overlong_drop_leaves_out_and_counts_the_long_ones(tmp_path, capsys):
    conversations = make_conversations(60, seed=1, long_every=5)
    source = write_jsonl(tmp_path / "chat.jsonl", conversations)
    code, out, err = data(capsys, "pack", source, "--output", tmp_path / "p", "--seq-len", 300, "--tokenizer", "byte",
                          "--template", "chatml", "--overlong", "drop")
    assert code == 0, err
    expected, counts = expected_examples(conversations, 300, "drop")
    assert counts["dropped"] > 0
    rows, _ = read_rows(tmp_path / "p")
    assert Counter(conversations_in(rows, 300, BYTE.pad_id)) == Counter(expected)
    fields = summary_of(out, "pack")
    assert fields["dropped"] == str(counts["dropped"]) and fields["truncated"] == "0"
    assert fields["kept"] == str(len(expected)) and fields["documents"] == "60"


def output_bytes(directory: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(directory.iterdir())]


def test_output_depends_on_the_seed_only_not_on_workers(tmp_path, capsys):
    source = write_jsonl(tmp_path / "chat.jsonl", make_conversations(200, seed=2, long_every=7))
    runs = {}
    for name, workers, seed in (("a", 1, 3), ("b", 2, 3), ("c", 1, 4)):
        code, _, err = data(capsys, "pack", source, "--output", tmp_path / name, "--seq-len", 256, "--tokenizer",
                            "byte", "--template", "chatml", "--seed", seed, "--workers", workers)
        assert code == 0, err
        runs[name] = output_bytes(tmp_path / name)
    assert runs["a"] == runs["b"]  # two workers: byte for byte the same
    assert runs["a"] != runs["c"]
    rows_a, _ = read_rows(tmp_path / "a")
    rows_c, _ = read_rows(tmp_path / "c")
    assert rows_a["input_ids"] != rows_c["input_ids"]  # another seed: other rows, in another order ...
    assert (Counter(conversations_in(rows_a, 256, BYTE.pad_id))
            == Counter(conversations_in(rows_c, 256, BYTE.pad_id)))  # ... of the same conversations


def test_a_bad_conversation_is_named_by_file_and_line_and_leaves_no_output(tmp_path, capsys):
    lines = [json.dumps(c) for c in make_conversations(4)]
    lines.insert(2, json.dumps({"messages": [{"role": "user", "text": "no content"}]}))
    source = tmp_path / "chat.jsonl"
    source.write_text("\n".join(lines) + "\n")
    code, out, err = data(capsys, "pack", source, "--output", tmp_path / "p", "--seq-len", 256, "--tokenizer", "byte",
                          "--template", "chatml")
    assert code == 2 and out == ""
    assert err.startswith(f"maester data: error: {source}:3: field 'messages', message 0"), err
    assert not (tmp_path / "p").exists()


def test_skip_invalid_counts_each_reason_and_packs_the_rest(tmp_path, capsys):
    good = make_conversations(5, seed=3)
    source = tmp_path / "chat.jsonl"
    source.write_text("\n".join([
        json.dumps(good[0]), "{not json", json.dumps(good[1]),
        json.dumps({"messages": [{"role": "user", "content": "no assistant turn"}]}),  # nothing to train
        json.dumps(good[2]), json.dumps({"messages": []}), *map(json.dumps, good[3:])]) + "\n")
    code, out, err = data(capsys, "pack", source, "--output", tmp_path / "p", "--seq-len", 512, "--tokenizer", "byte",
                          "--template", "chatml", "--skip-invalid")
    assert code == 0, err
    fields = summary_of(out, "pack")
    assert fields["kept"] == "5" and fields["skipped"] == "3"
    assert "invalid messages: 1" in out and "malformed JSON: 1" in out and "nothing to train: 1" in out
    rows, _ = read_rows(tmp_path / "p")
    assert Counter(conversations_in(rows, 512, BYTE.pad_id)) == Counter(expected_examples(good, 512, "truncate")[0])


def test_user_errors_exit_2_with_a_clear_message(tmp_path, capsys):
    source = write_jsonl(tmp_path / "chat.jsonl", make_conversations(3))
    base = ["pack", source, "--tokenizer", "byte"]
    code, _, err = data(capsys, *base, "--output", tmp_path / "p", "--seq-len", 0)
    assert code == 2 and "--seq-len must be at least 1, got 0" in err
    code, _, err = data(capsys, *base, "--output", tmp_path / "p", "--seq-len", 64, "--template", "chatgpt")
    assert code == 2 and "--template: Input should be" in err and "'chatml'" in err
    code, _, err = data(capsys, *base, "--output", tmp_path / "p", "--seq-len", 8, "--overlong", "drop")
    assert code == 2 and "no conversation to pack: 3 read, 3 longer than --seq-len 8 and dropped" in err
    assert not (tmp_path / "p").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "part-00000.parquet").write_bytes(b"old")
    code, _, err = data(capsys, *base, "--output", tmp_path / "full", "--seq-len", 512)
    assert code == 2 and "already holds part-00000.parquet" in err
    assert (tmp_path / "full" / "part-00000.parquet").read_bytes() == b"old"
