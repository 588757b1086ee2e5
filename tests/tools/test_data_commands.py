"""`maester data tokenize / merge / inspect / count / convert`, run through the real command line on tiny files."""

from __future__ import annotations

import base64
import gzip
import json
import random
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from maester.cli import main
from maester.config import TokenizerConfig
from maester.data.indexed import IndexedDataset
from maester.data.tokenizers import build_tokenizer
from maester.tools.data_tokenize import tokenizer_config
from tests.helpers import WORDS

BYTE = build_tokenizer(TokenizerConfig(kind="byte"))


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    extra = ["Grüße aus Zürich", "naïve café", "日本語", "emoji 🚀", "tab\there", "line\nbreak"]
    return [" ".join(rng.choice(WORDS + extra) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_docs(path: Path, docs: list[str]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.table({"text": docs}), path)
        return path
    return write_jsonl(path, [{"text": d, "id": i} for i, d in enumerate(docs)])


def data(capsys, *args) -> tuple[int, str, str]:
    """`maester data ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        main(["data", *map(str, args)])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def summary_of(out: str, command: str) -> dict[str, str]:
    """The key=value fields of the summary line (the last line of stdout)."""
    line = out.strip().splitlines()[-1]
    assert line.startswith(f"{command}: "), line
    fields = {}
    for word in line.removeprefix(f"{command}: ").split(" "):
        if "=" in word:
            key, value = word.split("=", 1)
            fields[key] = value
    return fields


def read_docs(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    assert ds.doc_idx.tolist() == list(range(len(ds) + 1))
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE trained here, with <s>/</s> named in tokenizer_config.json beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_docs(200, seed=1), trainer)
    directory = tmp_path_factory.mktemp("hf")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


# ---------------------------------------------------------------- tokenize


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet"])
def test_tokenize_each_format_gives_encode_plus_eos_per_document(tmp_path, capsys, name):
    docs = make_docs(30)
    source = write_docs(tmp_path / name, docs)
    code, out, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "out", "--tokenizer", "byte",
                          "--append-eod", "--chunk-size", 7)
    assert code == 0, err
    expected = [BYTE.encode(d) + [BYTE.eos_id] for d in docs]
    assert read_docs(tmp_path / "out_text_document") == expected
    assert IndexedDataset(tmp_path / "out_text_document").dtype == np.uint16  # vocab 269 < 65500
    fields = summary_of(out, "tokenize")
    assert fields["documents"] == "30" and fields["tokens"] == str(sum(map(len, expected)))
    assert fields["skipped"] == "0" and "tokens/s" in fields and fields["elapsed"].endswith("s")


def test_tokenize_without_eod_with_bos_and_control_tokens(tmp_path, capsys):
    docs = ["plain text", "a <<<|eot|>>> marker"]
    source = write_docs(tmp_path / "d.jsonl", docs)
    code, _, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "o", "--tokenizer", "byte",
                        "--add-bos", "--control-tokens", "<<<|eot|>>>=<|end_of_text|>")
    assert code == 0, err
    bos, eos = BYTE.bos_id, BYTE.eos_id
    assert read_docs(tmp_path / "o_text_document") == [
        [bos] + BYTE.encode("plain text"), [bos] + BYTE.encode("a ") + [eos] + BYTE.encode(" marker")]


def test_tokenize_with_an_hf_tokenizer_matches_its_encode(tmp_path, capsys, hf_tokenizer):
    docs = make_docs(25, seed=3)
    source = write_docs(tmp_path / "d.jsonl", docs)
    code, _, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "o", "--tokenizer",
                        hf_tokenizer / "tokenizer.json", "--append-eod")
    assert code == 0, err
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_tokenizer)))
    assert read_docs(tmp_path / "o_text_document") == [tok.encode(d) + [tok.eos_id] for d in docs]
    assert tok.encode(docs[0]) != BYTE.encode(docs[0])  # the BPE really merged something


def test_one_and_three_workers_write_identical_bytes(tmp_path, capsys, hf_tokenizer):
    source = write_docs(tmp_path / "d.jsonl", make_docs(120, seed=4))
    outputs = []
    for workers in (1, 3):
        prefix = tmp_path / f"w{workers}"
        code, out, err = data(capsys, "tokenize", source, "--output-prefix", prefix, "--tokenizer", hf_tokenizer,
                              "--append-eod", "--workers", workers, "--chunk-size", 9)
        assert code == 0, err
        assert summary_of(out, "tokenize")["documents"] == "120"
        outputs.append(tuple(Path(f"{prefix}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")))
    assert outputs[0] == outputs[1]
    assert len(IndexedDataset(tmp_path / "w3_text_document")) == 120


def test_token_parquet_output(tmp_path, capsys):
    docs = make_docs(12)
    source = write_docs(tmp_path / "d.parquet", docs)
    code, out, err = data(capsys, "tokenize", source, "--output-prefix", tmp_path / "tok", "--tokenizer", "byte",
                          "--format", "parquet", "--append-eod", "--chunk-size", 5)
    assert code == 0, err
    table = pq.read_table(tmp_path / "tok.parquet")
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.column("input_ids").to_pylist() == [BYTE.encode(d) + [BYTE.eos_id] for d in docs]
    assert summary_of(out, "tokenize")["output"] == str(tmp_path / "tok.parquet")


# ---------------------------------------------------------------- merge


def neox_merged(prefix: Path, docs: list[list[int]]) -> Path:
    """A GPT-NeoX merge_datasets.py output: one sequence per document but doc_idx = [0]."""
    sizes = [len(d) for d in docs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1] * 2]).tolist()
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), 1) + struct.pack(f"<{len(docs)}i", *sizes)
           + struct.pack(f"<{len(docs)}q", *pointers) + struct.pack("<q", 0))
    Path(f"{prefix}.idx").write_bytes(idx)
    Path(f"{prefix}.bin").write_bytes(np.array([t for d in docs for t in d], dtype="<u2").tobytes())
    return prefix


def test_merge_concatenates_and_merges_doc_idx(tmp_path, capsys):
    a, b = make_docs(4, seed=5), make_docs(3, seed=6)
    for name, docs in (("a", a), ("b", b)):
        code, _, err = data(capsys, "tokenize", write_docs(tmp_path / f"{name}.jsonl", docs), "--output-prefix",
                            tmp_path / name, "--tokenizer", "byte")
        assert code == 0, err
    neox = neox_merged(tmp_path / "neox", [[1, 2, 3], [4, 5]])
    assert IndexedDataset(neox).doc_idx_from_file is False
    # inputs as the tokenize prefix, as a .idx path, and as a plain prefix
    code, out, err = data(capsys, "merge", tmp_path / "a", tmp_path / "b_text_document.idx", neox,
                          "--output-prefix", tmp_path / "all")
    assert code == 0, err
    merged = IndexedDataset(tmp_path / "all")
    assert merged.doc_idx_from_file and merged.doc_idx.tolist() == list(range(10))
    assert [merged[i].tolist() for i in range(9)] == [BYTE.encode(d) for d in a + b] + [[1, 2, 3], [4, 5]]
    fields = summary_of(out, "merge")
    assert fields["documents"] == "9" and fields["inputs"] == "3"


def test_merge_of_a_missing_prefix_is_an_error(tmp_path, capsys):
    code, out, err = data(capsys, "merge", tmp_path / "nope", "--output-prefix", tmp_path / "all")
    assert code == 2 and "maester data: error:" in err and "nope" in err
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- inspect


def test_inspect_an_indexed_dataset_shows_text_ids_and_pieces(tmp_path, capsys, hf_tokenizer):
    docs = ["the model reads a token", "naïve café", "never shown"]
    data(capsys, "tokenize", write_docs(tmp_path / "d.jsonl", docs), "--output-prefix", tmp_path / "o",
         "--tokenizer", hf_tokenizer, "--append-eod")
    code, out, err = data(capsys, "inspect", tmp_path / "o", "-n", 2, "--tokenizer", hf_tokenizer)
    assert code == 0, err
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_tokenizer)))
    assert "3 documents" in out
    assert "the model reads a token</s>" in out and "naïve café</s>" in out and "never shown" not in out
    for tid in tok.encode("naïve café") + [tok.eos_id]:  # each id beside its piece, as a table row
        assert f"{tid}  {json.dumps(tok.decode([tid]), ensure_ascii=False)}\n" in out
    assert summary_of(out, "inspect")["documents"] == "2"


def test_inspect_without_a_tokenizer_lists_ids(tmp_path, capsys):
    data(capsys, "tokenize", write_docs(tmp_path / "d.jsonl", ["ab"]), "--output-prefix", tmp_path / "o",
         "--tokenizer", "byte")
    code, out, err = data(capsys, "inspect", tmp_path / "o_text_document")
    assert code == 0, err
    assert "pass --tokenizer" in out and "\n97\n98\n" in out.replace(" ", "")


def test_inspect_raw_jsonl_and_token_parquet(tmp_path, capsys):
    source = write_docs(tmp_path / "d.jsonl", ["hi there", "second"])
    code, out, err = data(capsys, "inspect", source, "-n", 1, "--tokenizer", "byte")
    assert code == 0, err
    assert f"{source}:1" in out and "hi there" in out and '104  "h"' in out and "second" not in out

    data(capsys, "tokenize", source, "--output-prefix", tmp_path / "t", "--tokenizer", "byte", "--format", "parquet")
    code, out, err = data(capsys, "inspect", tmp_path / "t.parquet", "--tokenizer", "byte")
    assert code == 0, err
    assert "token Parquet, 2 documents" in out and "second" in out and '115  "s"' in out

    code, _, err = data(capsys, "inspect", source)
    assert code == 2 and "pass --tokenizer" in err


# ---------------------------------------------------------------- count


def test_count_writes_one_number_per_document_and_prints_totals(tmp_path, capsys):
    docs = make_docs(40, seed=7)
    a = write_docs(tmp_path / "a.jsonl.gz", docs[:25])
    b = write_docs(tmp_path / "b.parquet", docs[25:])
    code, out, err = data(capsys, "count", a, b, "--tokenizer", "byte", "--output", tmp_path / "counts.txt",
                          "--append-eod", "--chunk-size", 6)
    assert code == 0, err
    lengths = [len(BYTE.encode(d)) + 1 for d in docs]
    assert (tmp_path / "counts.txt").read_text() == "".join(f"{n}\n" for n in lengths)
    fields = summary_of(out, "count")
    assert fields["documents"] == "40" and fields["tokens"] == str(sum(lengths))
    assert fields["max"] == str(max(lengths)) and fields["mean"] == f"{sum(lengths) / 40:.2f}"


# ---------------------------------------------------------------- convert


def test_convert_jsonl_to_parquet_shards_and_back(tmp_path, capsys):
    docs = make_docs(300, seed=8)
    source = write_docs(tmp_path / "in.jsonl.zst", docs)  # records {"text", "id"}
    code, out, err = data(capsys, "convert", source, "--output-dir", tmp_path / "pq", "--to", "parquet",
                          "--shard-size-mb", 0.01)
    assert code == 0, err
    shards = sorted((tmp_path / "pq").iterdir())
    assert len(shards) >= 3 and [p.name for p in shards] == [f"part-{i:05d}.parquet" for i in range(len(shards))]
    fields = summary_of(out, "convert")
    assert fields["documents"] == "300" and fields["shards"] == str(len(shards))
    assert fields["dropped_fields"] == "id"  # Parquet keeps the text column only, and says what it dropped
    assert [t for p in shards for t in pq.read_table(p).column("text").to_pylist()] == docs

    code, out, err = data(capsys, "convert", tmp_path / "pq", "--output-dir", tmp_path / "back", "--to", "jsonl",
                          "--shard-size-mb", 0.02)
    assert code == 0, err
    back = sorted((tmp_path / "back").iterdir())
    assert len(back) >= 2 and back[0].name == "part-00000.jsonl"
    lines = [line for p in back for line in p.read_text().splitlines()]
    assert [json.loads(line) for line in lines] == [{"text": d} for d in docs]


def test_convert_conversations_keep_messages_as_json(tmp_path, capsys):
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} é"}]
             for i in range(5)]
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    code, out, err = data(capsys, "convert", source, "--output-dir", tmp_path / "pq", "--to", "parquet")
    assert code == 0, err
    table = pq.read_table(tmp_path / "pq" / "part-00000.parquet")
    assert table.schema.field("messages").type == pa.string()
    assert [json.loads(s) for s in table.column("messages").to_pylist()] == convs
    assert summary_of(out, "convert")["kind"] == "messages"

    code, _, err = data(capsys, "convert", tmp_path / "pq", "--output-dir", tmp_path / "back", "--to", "jsonl")
    assert code == 0, err
    lines = (tmp_path / "back" / "part-00000.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"messages": m} for m in convs]


def test_convert_refuses_a_directory_with_old_shards(tmp_path, capsys):
    source = write_docs(tmp_path / "in.jsonl", ["a"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "part-00007.parquet").write_bytes(b"old")
    code, _, err = data(capsys, "convert", source, "--output-dir", tmp_path / "out", "--to", "parquet")
    assert code == 2 and "part-00007.parquet" in err


# ---------------------------------------------------------------- the tokenizer spec


def test_tokenizer_spec_kinds(tmp_path, hf_tokenizer):
    assert tokenizer_config("byte").kind == "byte"
    assert tokenizer_config(str(hf_tokenizer)).kind == "hf"
    assert tokenizer_config(str(hf_tokenizer / "tokenizer.json")).path == str(hf_tokenizer / "tokenizer.json")
    ranks = tmp_path / "tokenizer.model"  # Llama 3 names its tiktoken rank file .model
    ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    cfg = tokenizer_config(str(ranks), eos_token="<|eot|>", special_tokens={"<|eot|>": 256})
    assert cfg.kind == "tiktoken" and build_tokenizer(cfg).eos_id == 256
    with pytest.raises(ValueError, match="--special-tokens"):
        tokenizer_config(str(ranks))
    assert tokenizer_config(str(ranks), eos_token="<|eot|>", special_tokens={"<|eot|>": 256},
                            pattern="gpt2").pattern == "gpt2"  # --pattern
    with pytest.raises(ValueError, match="--pattern applies to tiktoken rank files only"):
        tokenizer_config("byte", pattern="gpt2")
    (tmp_path / "sp.model").write_bytes(b"\x0a\x0b\x00protobuf")
    assert tokenizer_config(str(tmp_path / "sp.model")).kind == "sentencepiece"
    with pytest.raises(FileNotFoundError, match="no such file"):
        tokenizer_config(str(tmp_path / "missing.json"))
