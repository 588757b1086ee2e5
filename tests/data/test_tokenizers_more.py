"""SentencePiece and tiktoken tokenizers, and control-token markers over every kind (tiny files built here)."""

from __future__ import annotations

import base64
import io
import logging
import re
from pathlib import Path

import pytest

from maester.config import Config, TokenizerConfig
from maester.data.tokenizers import (
    ByteTokenizer,
    ControlTokens,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
)

CORPUS = [
    "the cat sat on the mat", "the dog sat on the log", "translate this sentence please",
    "Sveiki, how are you today?", "a model reads tokens and predicts the next token",
    "Hello, world! The quick brown fox jumps over the lazy dog.", "<<<|markers|>>> with | pipes and <angles>",
    "spaces and\ttabs\nnewlines",
] * 10
TEXTS = ["the cat sat on the mat", "Hello, world!", "Translate this", "  two  spaces and\ttabs\nnewlines "]
USER, ASSISTANT = "<|user|>", "<|assistant|>"
MAPPING = {"<<<|user|>>>": USER, "<<<|assistant|>>>": ASSISTANT}
MARKED = "<<<|user|>>>Translate this<<<|user|>>><<<|assistant|>>>Sveiki<<<|assistant|>>>"


# ---------------------------------------------------------------- tiny tokenizer files


def write_sentencepiece(path: Path, **options) -> Path:
    import sentencepiece as spm

    buf = io.BytesIO()
    args = dict(vocab_size=100, model_type="bpe", character_coverage=1.0, hard_vocab_limit=False,
                user_defined_symbols=[USER, ASSISTANT], control_symbols=["<|system|>"],
                normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    args.update(options)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, **args)
    path.write_bytes(buf.getvalue())
    return path


MERGES = [b"th", b"the", b" t", b" the", b"at", b"on", b" s", b" sat", b"is", b" c", b" cat", b"ll", b"He", b"llo"]


def write_ranks(path: Path) -> Path:
    """All 256 single bytes, then a few merges, as `<base64 token> <rank>` lines."""
    tokens = [bytes([b]) for b in range(256)] + MERGES
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


N_RANKS = 256 + len(MERGES)
TIKTOKEN_SPECIALS = {"<|begin_of_text|>": N_RANKS, "<|endoftext|>": N_RANKS + 1, USER: N_RANKS + 2,
                     ASSISTANT: N_RANKS + 3}


def write_hf(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", USER, ASSISTANT],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("toks")
    return {"sp": write_sentencepiece(d / "sp.model"), "ranks": write_ranks(d / "ranks.tiktoken"),
            "hf": write_hf(d / "tokenizer.json")}


def make(kind: str, files: dict[str, Path]):
    if kind == "hf":
        return HFTokenizer(files["hf"], eos_token="</s>")
    if kind == "sentencepiece":
        return SentencePieceTokenizer(files["sp"])
    if kind == "tiktoken":
        return TiktokenTokenizer(files["ranks"], special_tokens=TIKTOKEN_SPECIALS, eos_token="<|endoftext|>")
    return ByteTokenizer()


# ---------------------------------------------------------------- SentencePiece


def test_sentencepiece_round_trip_and_model_special_ids(files):
    tok = SentencePieceTokenizer(files["sp"])
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(files["sp"]))
    assert tok.vocab_size == sp.get_piece_size()
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (sp.bos_id(), sp.eos_id(), None)  # pad_id -1: absent
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat")
    # A control symbol's text is text, never its id.
    assert tok.token_to_id("<|system|>") not in tok.encode("<|system|>")


def test_sentencepiece_config_overrides_and_pad(files, tmp_path):
    tok = build_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(files["sp"]), bos_token=USER,
                                          eos_token=ASSISTANT, pad_token="<|system|>"))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (tok.token_to_id(USER), tok.token_to_id(ASSISTANT),
                                                     tok.token_to_id("<|system|>"))
    padded = SentencePieceTokenizer(write_sentencepiece(tmp_path / "pad.model", pad_id=3,
                                                        control_symbols=[]))
    assert padded.pad_id == 3
    with pytest.raises(ValueError, match=re.escape("special token '<|nope|>' is not in the vocabulary")):
        SentencePieceTokenizer(files["sp"], eos_token="<|nope|>")


def test_sentencepiece_without_eos_is_an_error(files, tmp_path):
    path = write_sentencepiece(tmp_path / "noeos.model", eos_id=-1)
    with pytest.raises(ValueError, match="no EOS token") as err:
        SentencePieceTokenizer(path)
    assert str(path) in str(err.value)
    tok = SentencePieceTokenizer(path, eos_token=USER)  # named in the config it works
    assert tok.eos_id == tok.token_to_id(USER)
    with pytest.raises(FileNotFoundError, match="missing.model"):
        SentencePieceTokenizer(tmp_path / "missing.model")


# ---------------------------------------------------------------- tiktoken


def test_tiktoken_round_trip_specials_and_vocab(files):
    tok = build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(files["ranks"]),
                                          special_tokens=TIKTOKEN_SPECIALS, bos_token="<|begin_of_text|>",
                                          eos_token="<|endoftext|>"))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == N_RANKS + len(TIKTOKEN_SPECIALS)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (N_RANKS, N_RANKS + 1, None)
    for text in TEXTS + ["Grüße 🚀 日本語"]:
        ids = tok.encode(text)
        assert all(0 <= i < N_RANKS for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.encode("the cat sat") == [MERGES.index(m) + 256 for m in (b"the", b" cat", b" sat")]
    assert tok.decode([tok.bos_id, *tok.encode("the"), tok.eos_id]) == "<|begin_of_text|>the<|endoftext|>"


def test_tiktoken_special_token_text_is_ordinary_text(files):
    tok = make("tiktoken", files)
    text = "end<|endoftext|>here"
    ids = tok.encode(text)
    assert tok.eos_id not in ids
    assert all(i < N_RANKS for i in ids)
    assert tok.decode(ids) == text
    assert ids == list(tok._enc.encode(text, disallowed_special=()))


def test_tiktoken_needs_eos_and_known_specials(files, tmp_path):
    with pytest.raises(ValueError, match="no EOS token") as err:
        TiktokenTokenizer(files["ranks"], special_tokens=TIKTOKEN_SPECIALS)
    assert str(files["ranks"]) in str(err.value)
    with pytest.raises(ValueError, match=re.escape("'<|eot|>' is not in the vocabulary")):
        TiktokenTokenizer(files["ranks"], special_tokens=TIKTOKEN_SPECIALS, eos_token="<|eot|>")
    with pytest.raises(ValueError, match="already the rank of"):
        TiktokenTokenizer(files["ranks"], special_tokens={"<|endoftext|>": 5}, eos_token="<|endoftext|>")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("QQ== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match="line 2"):
        TiktokenTokenizer(bad, special_tokens={"<|endoftext|>": 9}, eos_token="<|endoftext|>")
    bad.write_text("QQ== 0\n")
    with pytest.raises(ValueError, match="single bytes have no rank"):
        TiktokenTokenizer(bad, special_tokens={"<|endoftext|>": 9}, eos_token="<|endoftext|>")


def test_tiktoken_custom_pattern(files):
    words = TiktokenTokenizer(files["ranks"], pattern=r"\S+|\s+", special_tokens=TIKTOKEN_SPECIALS,
                              eos_token="<|endoftext|>")
    # With whitespace split off, " the" can no longer be one token.
    assert words.encode(" the") == [ord(" "), 256 + MERGES.index(b"the")]
    assert make("tiktoken", files).encode(" the") == [256 + MERGES.index(b" the")]


def test_tiktoken_named_pattern_and_the_warning_without_one(tmp_path, caplog):
    """A GPT-2 rank file split with cl100k's default regex tokenizes differently (digits in threes): without
    `tokenizer.pattern` the load warns; `pattern = "gpt2"` is tiktoken's own GPT-2 regex."""
    from tiktoken_ext.openai_public import r50k_pat_str

    from maester.data.tokenizers import NAMED_PATTERNS

    assert NAMED_PATTERNS["gpt2"] == r50k_pat_str
    tokens = [bytes([b]) for b in range(256)] + [b"12", b"34", b"1234", b"12345"]
    ranks = tmp_path / "gpt2-like.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    specials = {"<|endoftext|>": len(tokens)}
    with caplog.at_level(logging.WARNING, logger="maester"):
        default = TiktokenTokenizer(ranks, special_tokens=specials, eos_token="<|endoftext|>")
    assert f"tiktoken rank file {ranks} (260 ranks): tokenizer.pattern is unset" in caplog.text
    assert "a name (gpt2, r50k_base, p50k_base, cl100k_base, llama3)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="maester"):
        gpt2 = TiktokenTokenizer(ranks, pattern="gpt2", special_tokens=specials, eos_token="<|endoftext|>")
    assert caplog.text == ""
    assert default.encode("12345") == [256, ord("3"), ord("4"), ord("5")]  # "123" and "45"
    assert gpt2.encode("12345") == [259]


# ---------------------------------------------------------------- control tokens (acceptance)


@pytest.mark.parametrize("kind", ["hf", "sentencepiece", "tiktoken"])
def test_control_tokens_ids_are_the_spans_with_special_ids_at_markers(files, kind):
    inner = make(kind, files)
    tok = ControlTokens(inner, MAPPING)
    user, asst = inner.token_to_id(USER), inner.token_to_id(ASSISTANT)
    assert user is not None and asst is not None and user != asst
    expected = [user] + inner.encode("Translate this") + [user, asst] + inner.encode("Sveiki") + [asst]
    assert tok.encode(MARKED) == expected
    assert tok.encode_batch([MARKED, "plain text", ""]) == [expected, inner.encode("plain text"), []]
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == \
        (inner.vocab_size, inner.bos_id, inner.eos_id, inner.pad_id)
    assert tok.path == inner.path
    assert tok.decode(inner.encode("Sveiki")) == inner.decode(inner.encode("Sveiki"))
    assert not tok.unknown_markers


@pytest.mark.parametrize("kind", ["hf", "sentencepiece", "tiktoken", "byte"])
def test_unmapped_markers_stay_text_and_are_reported(files, kind, caplog):
    inner = make(kind, files)
    mapping = MAPPING if kind != "byte" else {"<<<|bos|>>>": "<|begin_of_text|>"}
    tok = ControlTokens(inner, mapping)
    with caplog.at_level(logging.WARNING, logger="maester"):
        ids = tok.encode("<<<|system|>>>be brief")
        assert ids == inner.encode("<<<|system|>>>be brief")
        tok.encode_batch(["x<<<|system|>>>y<<<|system|>>>", "<<<|tool|>>>"])
    assert tok.unknown_markers == {"system": 3, "tool": 1}
    warned = [r.getMessage() for r in caplog.records if "not in tokenizer.control_tokens" in r.getMessage()]
    assert len(warned) == 2 and "<<<|system|>>>" in warned[0] and "<<<|tool|>>>" in warned[1]


def test_longest_marker_wins_and_byte_tokenizer_markers(files):
    tok = ControlTokens(ByteTokenizer(), {"<<<|eot|>>>": "<|end_of_text|>", "<<<|eot|>>>!": "<|pad|>"})
    assert tok.encode("a<<<|eot|>>>!b<<<|eot|>>>") == [ord("a"), 258, ord("b"), 257]


@pytest.mark.parametrize("kind", ["hf", "sentencepiece", "tiktoken", "byte"])
def test_mapping_to_a_missing_token_is_an_error(files, kind):
    with pytest.raises(ValueError, match=re.escape("'<|tool|>', which is not in the vocabulary")) as err:
        ControlTokens(make(kind, files), {"<<<|tool|>>>": "<|tool|>"})
    if kind == "byte":
        assert "<|begin_of_text|>" in str(err.value)


def test_build_tokenizer_applies_control_tokens(files):
    cfg = TokenizerConfig(kind="tiktoken", path=str(files["ranks"]), special_tokens=TIKTOKEN_SPECIALS,
                          eos_token="<|endoftext|>", control_tokens=MAPPING)
    tok = build_tokenizer(cfg)
    assert isinstance(tok, ControlTokens) and isinstance(tok.inner, TiktokenTokenizer)
    assert tok.encode("<<<|user|>>>hi") == [TIKTOKEN_SPECIALS[USER], *tok.inner.encode("hi")]
    byte = build_tokenizer(TokenizerConfig(kind="byte", control_tokens={"<<<|eot|>>>": "<|end_of_text|>"}))
    assert byte.encode("hi<<<|eot|>>>") == [ord("h"), ord("i"), 257]
    chat = build_tokenizer(TokenizerConfig(kind="byte", control_tokens=MAPPING))  # the chat roles are built in
    assert chat.encode("<<<|user|>>>hi") == [ByteTokenizer().token_to_id(USER), ord("h"), ord("i")]
    with pytest.raises(ValueError, match="its special tokens are only"):
        build_tokenizer(TokenizerConfig(kind="byte", control_tokens={"<<<|tool|>>>": "<|tool|>"}))


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "hf"])
def test_config_path_required(kind):
    with pytest.raises(ValueError, match=f"tokenizer.path is required when tokenizer.kind = '{kind}'"):
        TokenizerConfig(kind=kind)


def test_config_tiktoken_only_fields():
    with pytest.raises(ValueError, match="tokenizer.pattern is only used when tokenizer.kind = 'tiktoken'"):
        TokenizerConfig(kind="sentencepiece", path="x.model", pattern=r"\S+")
    with pytest.raises(ValueError, match="tokenizer.special_tokens is only used"):
        TokenizerConfig(kind="byte", special_tokens={"<|x|>": 3})
    with pytest.raises(ValueError, match="marker and token must be non-empty"):
        TokenizerConfig(control_tokens={"": "<|pad|>"})


def test_config_control_tokens_round_trip_through_json(tmp_path):
    cfg = Config(tokenizer=TokenizerConfig(kind="tiktoken", path="r.tiktoken", pattern=r"\S+|\s+",
                                           special_tokens=TIKTOKEN_SPECIALS, eos_token="<|endoftext|>",
                                           control_tokens=MAPPING))
    (tmp_path / "config.json").write_text(cfg.to_json())
    again = Config.from_json_file(tmp_path / "config.json")
    assert again.tokenizer == cfg.tokenizer
    assert again.tokenizer.control_tokens == MAPPING and again.tokenizer.special_tokens == TIKTOKEN_SPECIALS
