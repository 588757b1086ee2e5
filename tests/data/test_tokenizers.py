"""The byte tokenizer and Hugging Face `tokenizer.json` files (a real BPE trained here with `tokenizers`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from maester.config import TokenizerConfig
from maester.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus Zürich: naïve café, smörgåsbord and crème brûlée.",
    "日本語のテキストと emoji 🚀✨ mixed with ASCII.",
    "  leading and trailing spaces,\ttabs\nand newlines  ",
]


# ---------------------------------------------------------------- byte tokenizer


def test_byte_tokenizer_special_ids_and_vocab():
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 269)
    built = build_tokenizer(TokenizerConfig(kind="byte"))
    assert isinstance(built, ByteTokenizer)


@pytest.mark.parametrize("text", TEXTS + [""])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "x"]) == [ids, [ord("x")]]


def test_byte_tokenizer_decodes_special_ids_between_text():
    tok = ByteTokenizer()
    ids = [tok.bos_id, *tok.encode("café"), tok.eos_id, *tok.encode("ü"), tok.pad_id]
    assert tok.decode(ids) == "<|begin_of_text|>café<|end_of_text|>ü<|pad|>"
    # A multi-byte character is reassembled across the bytes, not decoded byte by byte.
    assert len(tok.encode("🚀")) == 4


@pytest.mark.parametrize("bad", [269, 1000, -1])
def test_byte_tokenizer_rejects_out_of_range_ids(bad):
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match=str(bad)):
        tok.decode([104, 105, bad])


# ---------------------------------------------------------------- Hugging Face tokenizer.json


SPECIALS = ["<s>", "</s>", "<pad>"]
TRAINING_TEXT = [
    "the cat sat on the mat", "the dog sat on the log", "a model reads tokens and predicts the next token",
    "Grüße aus Zürich", "naïve café", "日本語のテキスト", "emoji 🚀✨", "training a tiny byte level BPE",
] * 4


def write_bpe(directory: Path, tokenizer_config: dict | None, template: bool = True) -> Path:
    """Train a byte-level BPE on a few sentences, save `tokenizer.json` (and `tokenizer_config.json`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    if template:  # a template that adds <s> ... </s>: maester must encode without it
        s, e = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", s), ("</s>", e)])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


HF_CONFIG = {
    "bos_token": "<s>",  # a plain string
    "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
                  "single_word": False, "__type": "AddedToken"},  # an AddedToken object
    "pad_token": "<pad>",
    "model_max_length": 1024,
}


@pytest.fixture
def bpe(tmp_path) -> Path:
    return write_bpe(tmp_path / "tok", HF_CONFIG)


def vocab_of(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def test_hf_round_trip_without_template(bpe):
    tok = HFTokenizer(bpe)
    vocab = vocab_of(bpe)
    assert tok.vocab_size == len(vocab)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids, text
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        # The data pipeline adds BOS/EOS itself: the tokenizer's own template is not applied.
        assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    # The BPE merged something: common words are fewer tokens than bytes.
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat".encode())
    # Special tokens are decoded, not dropped.
    assert tok.decode([tok.bos_id, *tok.encode("the cat"), tok.eos_id]) == "<s>the cat</s>"


def test_hf_special_ids_come_from_tokenizer_config(bpe):
    vocab = vocab_of(bpe)
    tok = HFTokenizer(bpe)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (vocab["<s>"], vocab["</s>"], vocab["<pad>"])
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3


def test_hf_config_tokens_override_tokenizer_config(bpe):
    vocab = vocab_of(bpe)
    tok = HFTokenizer(bpe, bos_token="</s>", eos_token="<pad>", pad_token="<s>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (vocab["</s>"], vocab["<pad>"], vocab["<s>"])
    # Only the given one is overridden; the others still come from tokenizer_config.json.
    tok = HFTokenizer(bpe, eos_token="<pad>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (vocab["<s>"], vocab["<pad>"], vocab["<pad>"])


def test_hf_without_tokenizer_config_needs_an_eos(tmp_path):
    path = write_bpe(tmp_path / "bare", tokenizer_config=None)
    with pytest.raises(ValueError, match="no EOS token") as err:
        HFTokenizer(path)
    assert str(path) in str(err.value)
    # Given in the config it works, and BOS/pad stay unset.
    tok = HFTokenizer(path, eos_token="</s>")
    assert tok.eos_id == vocab_of(path)["</s>"]
    assert tok.bos_id is None and tok.pad_id is None


def test_hf_tokenizer_config_without_eos_is_an_error(tmp_path):
    path = write_bpe(tmp_path / "noeos", {"bos_token": "<s>", "eos_token": None})
    with pytest.raises(ValueError, match="no EOS token"):
        HFTokenizer(path)


@pytest.mark.parametrize("which", ["bos_token", "eos_token", "pad_token"])
def test_hf_special_token_not_in_vocab_is_an_error(bpe, which):
    with pytest.raises(ValueError, match=r"special token '<\|missing\|>' is not in the vocabulary") as err:
        HFTokenizer(bpe, **{which: "<|missing|>"})
    assert str(bpe) in str(err.value)


def test_hf_tokenizer_config_naming_an_unknown_token_is_an_error(tmp_path):
    path = write_bpe(tmp_path / "badcfg", {"eos_token": {"content": "<|eot|>"}})
    with pytest.raises(ValueError, match=re.escape("'<|eot|>' is not in the vocabulary")):
        HFTokenizer(path)


def test_hf_malformed_tokenizer_config_is_an_error(tmp_path):
    path = write_bpe(tmp_path / "malformed", None)
    (path.parent / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        HFTokenizer(path)


def test_build_tokenizer_accepts_the_file_and_its_directory(bpe):
    from_file = build_tokenizer(TokenizerConfig(kind="hf", path=str(bpe)))
    from_dir = build_tokenizer(TokenizerConfig(kind="hf", path=str(bpe.parent)))
    for tok in (from_file, from_dir):
        assert isinstance(tok, HFTokenizer)
        assert tok.path == bpe
    assert (from_file.vocab_size, from_file.bos_id, from_file.eos_id, from_file.pad_id) == \
        (from_dir.vocab_size, from_dir.bos_id, from_dir.eos_id, from_dir.pad_id)
    assert from_file.encode(TEXTS[1]) == from_dir.encode(TEXTS[1])
    over = build_tokenizer(TokenizerConfig(kind="hf", path=str(bpe.parent), eos_token="<pad>"))
    assert over.eos_id == from_dir.pad_id


def test_hf_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)  # a directory without tokenizer.json
    with pytest.raises(FileNotFoundError, match="nope.json"):
        build_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path / "nope.json")))
