"""SFT from pre-tokenized indexed data: `maester data tokenize --template` writes a token and a label dataset in
GPT-NeoX's layout, and the SFT loader reads them into the same rows as the conversations themselves."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

from maester.config import DataConfig, SFTConfig, TokenizerConfig
from maester.data.batch import BatchPlan
from maester.data.indexed import IndexedDatasetWriter
from maester.data.sft_loader import SFTLoader
from maester.data.tokenizers import build_tokenizer
from maester.tools.data_tokenize import tokenize
from tests.data.test_chat import (ASSISTANT_HEADER, CHATML_JINJA, CONVERSATION, END_OF_TURN, EXPECTED, MASKS,
                                  byte_ids, expected_trained, trained_spans)

MARKERS = {"<<<|user|>>>": "<|user|>", "<<<|assistant|>>>": "<|assistant|>"}
MARKED_TOKENIZER = TokenizerConfig(kind="byte", control_tokens=MARKERS)
WORDS = "labdien sveiki paldies translate the sentence into latvian please good morning how are you".split()


def marker_record(rng: random.Random, long: bool = False) -> dict:
    """One record of the seed's format: `<<<|user|>>>...<<<|user|>>><<<|assistant|>>>...<<<|assistant|>>>`."""
    text = ""
    for _ in range(rng.randint(1, 2)):
        q = " ".join(rng.choices(WORDS, k=rng.randint(2, 8) * (12 if long else 1)))
        a = " ".join(rng.choices(WORDS, k=rng.randint(1, 10)))
        text += f"<<<|user|>>>{q}<<<|user|>>><<<|assistant|>>>{a}<<<|assistant|>>>"
    return {"text": text}


def write_marker_jsonl(path, n: int, seed: int = 0, long_every: int = 0) -> None:
    rng = random.Random(seed)
    records = [marker_record(rng, long=bool(long_every) and i % long_every == 0) for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def tokenized(jsonl, prefix, tokenizer=MARKED_TOKENIZER, **chat) -> str:
    tokenize([str(jsonl)], str(prefix), tokenizer, chat={"template": "markers", **chat})
    return f"{prefix}_text_document"


def read_neox(prefix: str) -> tuple[int, list[np.ndarray]]:
    """The dtype code and sequences of an indexed dataset, parsed from the bytes as GPT-NeoX's reader does."""
    idx = open(f"{prefix}.idx", "rb").read()
    magic, version, code, n, _ = struct.unpack("<9sQBQQ", idx[:34])
    assert magic == b"MMIDIDX\x00\x00" and version == 1
    sizes = np.frombuffer(idx, "<i4", n, 34)
    pointers = np.frombuffer(idx, "<i8", n, 34 + 4 * n)
    data = open(f"{prefix}.bin", "rb").read()
    return code, [np.frombuffer(data, "<i4", int(s), int(p)) for s, p in zip(sizes, pointers)]


def loader(*sources: dict, tokenizer=MARKED_TOKENIZER, seq_len=256, overlong="truncate", batch=(4, 2, 1, 0)):
    data = DataConfig(mode="sft", sources=list(sources), seq_len=seq_len,
                      sft=SFTConfig(template="markers", overlong=overlong))
    return SFTLoader(data, tokenizer, build_tokenizer(tokenizer), seed=3, batch=BatchPlan(*batch))


def same_batches(a, b) -> bool:
    return all(x.input_ids.equal(y.input_ids) and x.labels.equal(y.labels) and x.position_ids.equal(y.position_ids)
               and x.document_ids.equal(y.document_ids) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ the files


@pytest.mark.parametrize("template", ["chatml", "llama3", "gemma", "jinja", "markers"])
@pytest.mark.parametrize("mask", MASKS)
def test_label_positions_per_template_and_mask(tmp_path, template, mask):
    """The label dataset holds token j where it is trained, -100 elsewhere (GPT-NeoX's aligned labels); the trained
    positions are derived here from the hand-written text of test_chat."""
    chat, tokenizer = {"template": template, "mask": mask}, TokenizerConfig(kind="byte")
    if template == "markers":
        turns = [(m["role"], m["content"]) for m in CONVERSATION]
        record = {"text": "".join(f"<<<|{r}|>>>{c}<<<|{r}|>>>" for r, c in turns)}
        text = "".join(f"<|{r}|>{c}<|{r}|>" for r, c in turns) + "<|end_of_text|>"
        header, end, tokenizer = "<|assistant|>", "<|assistant|>", MARKED_TOKENIZER
    else:
        record = {"messages": CONVERSATION}
        shape = "chatml" if template == "jinja" else template
        text, header, end = EXPECTED[shape, False], ASSISTANT_HEADER[shape], END_OF_TURN[shape]
        if template == "jinja":
            (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_JINJA}))
            chat["chat_template_path"] = str(tmp_path)
    (tmp_path / "c.jsonl").write_text(json.dumps(record) + "\n")
    summary = tokenize([str(tmp_path / "c.jsonl")], str(tmp_path / "out"), tokenizer, chat=chat)
    ids, starts = byte_ids(text)
    spans = trained_spans(text, header, end)
    if template == "markers":  # EOS is trained with the last assistant turn
        spans[-1] = (spans[-1][0], len(text))
    want = expected_trained(starts, spans, mask)
    code, [tokens] = read_neox(str(tmp_path / "out_text_document"))
    label_code, [labels] = read_neox(str(tmp_path / "out_label_document"))
    assert code == label_code == 4  # int32, as GPT-NeoX's SFT tools write both
    assert tokens.tolist() == ids
    assert labels.tolist() == np.where(want, ids, -100).tolist()
    assert summary.extra["trained"] == int(want.sum())


def test_gpt_neox_batches_train_what_the_loader_trains(tmp_path):
    """GPT-NeoX's `_get_batch` takes `label[1:]` (where >= 0) as the targets of `text[:-1]`; that is the loader's
    pre-shifted labels of the same conversation."""
    write_marker_jsonl(tmp_path / "seed.jsonl", 12)
    prefix = tokenized(tmp_path / "seed.jsonl", tmp_path / "seed")
    _, texts = read_neox(prefix)
    _, labels = read_neox(str(tmp_path / "seed_label_document"))
    ours = loader({"path": prefix}).sources[0].train
    assert len(ours) == len(texts) == 12
    for text, label, (tokens, shifted) in zip(texts, labels, ours):
        assert tokens.tolist() == text.tolist()
        assert shifted[:-1].tolist() == label[1:].tolist() and shifted[-1] == -100


def test_count_output_has_the_trained_tokens_of_each_conversation(tmp_path):
    """`maester data count PREFIX --output F` beside a label dataset: `tokens trained` per line (count_tokens.py's
    one number per line, plus what each conversation trains), the second column summing to `trained=`."""
    from maester.tools.data_tokenize import count

    write_marker_jsonl(tmp_path / "seed.jsonl", 12)
    prefix = tokenized(tmp_path / "seed.jsonl", tmp_path / "seed")
    _, texts = read_neox(prefix)
    _, labels = read_neox(str(tmp_path / "seed_label_document"))
    summary = count([str(tmp_path / "seed")], None, output=str(tmp_path / "counts.txt"))
    lines = [tuple(map(int, line.split())) for line in (tmp_path / "counts.txt").read_text().splitlines()]
    assert lines == [(len(t), int((label[1:] != -100).sum())) for t, label in zip(texts, labels)]
    assert summary.extra["trained"] == sum(trained for _, trained in lines) > 0


# ------------------------------------------------------------------ the loader


def test_indexed_prefixes_give_the_rows_of_the_jsonl_with_weights_validation_and_resume(tmp_path):
    write_marker_jsonl(tmp_path / "a.jsonl", 40, seed=1)
    write_marker_jsonl(tmp_path / "b.jsonl", 25, seed=2)
    a, b = tokenized(tmp_path / "a.jsonl", tmp_path / "a"), tokenized(tmp_path / "b.jsonl", tmp_path / "b")
    spec = [dict(name="a", weight=2.0, validation_fraction=0.2), dict(name="b", weight=0.5)]
    jsonl = loader({"path": str(tmp_path / "a.jsonl"), **spec[0]}, {"path": str(tmp_path / "b.jsonl"), **spec[1]})
    indexed = loader({"path": a, **spec[0]}, {"path": b, **spec[1]})
    assert len(indexed.sources[0].validation) > 0
    for _ in range(12):  # past the end of the first epoch
        assert same_batches(jsonl.next_step(), indexed.next_step())
    assert indexed.epoch >= 1
    assert same_batches(jsonl.validation_batches(2), indexed.validation_batches(2))
    state = indexed.state_dict()
    resumed = loader({"path": a, **spec[0]}, {"path": b, **spec[1]})
    resumed.load_state_dict(state)
    steps = [indexed.next_step() for _ in range(3)]
    for step in steps:
        assert same_batches(step, resumed.next_step())
    second_rank = loader({"path": a, **spec[0]}, {"path": b, **spec[1]}, batch=(4, 2, 2, 1))
    second_rank.load_state_dict(state)
    assert same_batches(steps[0][1:], second_rank.next_step())  # rows 2..3 of the step


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_conversation_longer_than_seq_len_follows_overlong(tmp_path, overlong):
    write_marker_jsonl(tmp_path / "long.jsonl", 30, long_every=7)
    prefix = tokenized(tmp_path / "long.jsonl", tmp_path / "long")
    sizes = [len(t) for t in read_neox(prefix)[1]]
    seq_len = 160
    assert max(sizes) > seq_len
    over = sum(s > seq_len for s in sizes)
    jsonl = loader({"path": str(tmp_path / "long.jsonl"), "name": "x"}, seq_len=seq_len, overlong=overlong)
    indexed = loader({"path": prefix, "name": "x"}, seq_len=seq_len, overlong=overlong)
    counts = indexed.sources[0].counts
    assert counts["read"] == 30 and counts["truncated" if overlong == "truncate" else "dropped"] == over
    assert counts == jsonl.sources[0].counts
    kept = indexed.sources[0].train
    assert len(kept) == (30 if overlong == "truncate" else 30 - over)
    assert max(len(t) for t, _ in kept) == (seq_len if overlong == "truncate" else max(s for s in sizes if s <= seq_len))
    for _ in range(3):
        assert same_batches(jsonl.next_step(), indexed.next_step())


# ------------------------------------------------------------------ bad files


def test_bad_label_datasets_are_named(tmp_path):
    write_marker_jsonl(tmp_path / "s.jsonl", 3)
    prefix = tokenized(tmp_path / "s.jsonl", tmp_path / "s")
    _, texts = read_neox(prefix)
    with pytest.raises(FileNotFoundError, match="other_label_document.idx does not exist"):
        loader({"path": prefix, "label_path": str(tmp_path / "other_label_document")})
    with IndexedDatasetWriter(tmp_path / "short", np.int32) as w:
        for t in texts:
            w.add_document(np.full(len(t) - (t is texts[1]), -100))
    with pytest.raises(ValueError, match=r"short: sequence 1 has \d+ labels, but .* sequence 1 has \d+ tokens"):
        loader({"path": prefix, "label_path": str(tmp_path / "short")})
    with IndexedDatasetWriter(tmp_path / "wrong", np.int32) as w:
        for t in texts:
            w.add_document(np.where(np.arange(len(t)) == 3, 5, -100) if t is texts[2] else np.full(len(t), -100))
    with pytest.raises(ValueError, match=r"wrong: sequence 2, label 3 = 5 differs from its token"):
        loader({"path": prefix, "label_path": str(tmp_path / "wrong")})
    (tmp_path / "plain.idx").write_bytes((tmp_path / "s_text_document.idx").read_bytes())
    (tmp_path / "plain.bin").write_bytes((tmp_path / "s_text_document.bin").read_bytes())
    with pytest.raises(ValueError, match="ending in '_text_document'.*label_path"):
        loader({"path": str(tmp_path / "plain")})
    for name, value in (("big_text_document", [267, 70000]), ("big_label_document", [-100, -100])):
        with IndexedDatasetWriter(tmp_path / name, np.int32) as w:
            w.add_document(np.array(value))
    with pytest.raises(ValueError, match=r"big_text_document: sequence 0, token 1 = 70000 is outside the tokenizer's"):
        loader({"path": str(tmp_path / "big_text_document")})
