"""Conversations to tokens and trained masks: built-in chat templates, Jinja templates, the marker format.

Expected texts are written out by hand; expected token positions are derived here from those texts (the byte
tokenizer spells every character as one byte and every special-token string as one id), never by the code tested.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from maester.config import SFTConfig
from maester.data.chat import IGNORE_INDEX, ChatEncoder, ChatTemplateError
from maester.data.records import InvalidRecord
from maester.data.tokenizers import ByteTokenizer, ControlTokens, HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer

CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say ok."},
    {"role": "assistant", "content": "ok"},
]
SYSTEM = {"role": "system", "content": "Be brief."}

EXPECTED = {
    ("chatml", False):
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nSay ok.<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n",
    ("chatml", True):
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nSay ok.<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n",
    ("llama3", False):
        "<|begin_of_text|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSay ok.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nok<|eot_id|>",
    ("llama3", True):
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSay ok.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nok<|eot_id|>",
    ("gemma", False):
        "<|begin_of_text|>"
        "<start_of_turn>user\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nSay ok.<end_of_turn>\n"
        "<start_of_turn>model\nok<end_of_turn>\n",
    ("gemma", True):
        "<|begin_of_text|>"
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nSay ok.<end_of_turn>\n"
        "<start_of_turn>model\nok<end_of_turn>\n",
}
# Per template: the assistant header (never trained) and the end-of-turn token (trained).
ASSISTANT_HEADER = {"chatml": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                    "gemma": "<start_of_turn>model\n"}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}
TEMPLATES = ("chatml", "llama3", "gemma")
MASKS = ("assistant_only", "all", "last_assistant_only")

# Real-world templates, written out by hand: ChatML as in the Hugging Face docs, Llama 3 and Gemma as their repos'
# tokenizer_config.json (string content only).
CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_JINJA = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA_JINJA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- generation -%}
    {{ message['content'] | trim }}
    {%- endgeneration -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
JINJA = {"chatml": CHATML_JINJA, "llama3": LLAMA3_JINJA, "gemma": GEMMA_JINJA}

HF_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>",
               "<|assistant|>"]
TRAINING_TEXT = ["Hello! How can I help?", "Hi there, say ok.", "user assistant system model", "Be brief.",
                 "Translate to Latvian: Good morning", "Labrit"] * 8
MARKERS = {"<<<|user|>>>": "<|user|>", "<<<|assistant|>>>": "<|assistant|>", "<<<|system|>>>": "<|system|>"}


def write_hf(directory: Path, specials=tuple(HF_SPECIALS), config: dict | None = None) -> Path:
    """A byte-level BPE trained here on a few sentences, with `specials` as added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"} if config is None else config
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer(write_hf(tmp_path_factory.mktemp("hf")))


def byte_ids(text: str) -> tuple[list[int], list[int]]:
    """The byte tokenizer's ids for an ASCII text, worked out here, and the character each token starts at."""
    specials = ByteTokenizer.SPECIAL_TOKENS
    pattern = re.compile("|".join(map(re.escape, specials)))
    ids, starts, pos = [], [], 0
    while pos < len(text):
        m = pattern.match(text, pos)
        ids.append(256 + specials.index(m.group()) if m else ord(text[pos]))
        starts.append(pos)
        pos = m.end() if m else pos + 1
    return ids, starts


def trained_spans(text: str, header: str, end: str) -> list[tuple[int, int]]:
    """Character spans of each assistant turn's content plus end-of-turn token, found after its header."""
    spans, pos = [], 0
    while (k := text.find(header, pos)) >= 0:
        start = k + len(header)
        stop = text.index(end, start) + len(end)
        spans.append((start, stop))
        pos = stop
    return spans


def expected_trained(starts: list[int], spans: list[tuple[int, int]], mask: str) -> np.ndarray:
    if mask == "all":
        return np.arange(len(starts)) > 0
    chosen = spans if mask == "assistant_only" else spans[-1:]
    return np.array([any(a <= s < b for a, b in chosen) for s in starts])


def shifted(ids: list[int], trained: np.ndarray) -> list[int]:
    return [ids[i + 1] if trained[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]


def trained_runs(tok, tokens: np.ndarray, trained: np.ndarray) -> list[str]:
    """The decoded text of each run of consecutive trained tokens."""
    runs, run = [], []
    for token, flag in zip(tokens.tolist(), trained.tolist()):
        if flag:
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


# ------------------------------------------------------------------ rendering


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("system", [False, True])
def test_render_matches_hand_written_text(template, system):
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template=template))
    messages = [SYSTEM, *CONVERSATION] if system else CONVERSATION
    assert enc.render(messages) == EXPECTED[template, system]


@pytest.mark.parametrize("template", TEMPLATES)
def test_system_prompt_goes_first_only_where_there_is_none(template):
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template=template, system_prompt="Be brief."))
    assert enc.render(CONVERSATION) == EXPECTED[template, True]
    own = {"role": "system", "content": "Be long."}
    assert enc.render([own, *CONVERSATION]) == EXPECTED[template, True].replace("Be brief.", "Be long.")
    plain = ChatEncoder(ByteTokenizer(), SFTConfig(template=template))
    assert np.array_equal(enc.encode(CONVERSATION).tokens, plain.encode([SYSTEM, *CONVERSATION]).tokens)


# ------------------------------------------------------------------ masks, byte tokenizer


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("system", [False, True])
def test_trained_positions_and_labels(template, mask, system):
    tok = ByteTokenizer()
    encoded = ChatEncoder(tok, SFTConfig(template=template, mask=mask)).encode(
        [SYSTEM, *CONVERSATION] if system else CONVERSATION)
    text = EXPECTED[template, system]
    ids, starts = byte_ids(text)
    want = expected_trained(starts, trained_spans(text, ASSISTANT_HEADER[template], END_OF_TURN[template]), mask)
    assert encoded.tokens.dtype == np.int64 and encoded.trained.dtype == bool
    assert encoded.tokens.tolist() == ids
    assert encoded.trained.tolist() == want.tolist()
    labels = encoded.labels()
    assert labels.dtype == np.int64 and labels.tolist() == shifted(ids, want)
    assert labels[-1] == IGNORE_INDEX == -100
    assert not encoded.trained[0]


@pytest.mark.parametrize("template", TEMPLATES)
def test_headers_untrained_end_of_turn_trained(template):
    tok = ByteTokenizer()
    encoded = ChatEncoder(tok, SFTConfig(template=template)).encode([SYSTEM, *CONVERSATION])
    end = tok.token_to_id(END_OF_TURN[template])
    ends = encoded.tokens == end
    # Every end-of-turn token is trained exactly when it closes an assistant turn: 2 of them.
    assert ends.sum() == len([SYSTEM, *CONVERSATION]) - (template == "gemma")
    assert (ends & encoded.trained).sum() == 2
    headers = [t for t in ByteTokenizer.SPECIAL_TOKENS if t != END_OF_TURN[template]]
    assert not encoded.trained[np.isin(encoded.tokens, [tok.token_to_id(t) for t in headers])].any()
    assert trained_runs(tok, encoded.tokens, encoded.trained) == [
        f"Hello! How can I help?{END_OF_TURN[template]}", f"ok{END_OF_TURN[template]}"]


def test_all_mask_trains_every_token_but_the_first():
    tok = ByteTokenizer()
    encoded = ChatEncoder(tok, SFTConfig(template="chatml", mask="all")).encode(CONVERSATION)
    assert encoded.trained.tolist() == [False] + [True] * (len(encoded.tokens) - 1)
    assert encoded.labels().tolist() == encoded.tokens[1:].tolist() + [-100]


# ------------------------------------------------------------------ Hugging Face tokenizer


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("mask", MASKS)
def test_hf_special_tokens_are_single_ids(hf, template, mask):
    encoded = ChatEncoder(hf, SFTConfig(template=template, mask=mask)).encode([SYSTEM, *CONVERSATION])
    text = EXPECTED[template, True]
    assert hf.decode(encoded.tokens.tolist()) == text
    for special in HF_SPECIALS:
        assert (encoded.tokens == hf.token_to_id(special)).sum() == text.count(special), special
    # Text pieces hold no special token spelled out in BPE pieces.
    plain = [t for t in encoded.tokens.tolist() if t not in {hf.token_to_id(s) for s in HF_SPECIALS}]
    assert "<" not in hf.decode(plain)
    end = END_OF_TURN[template]
    runs = {"assistant_only": [f"Hello! How can I help?{end}", f"ok{end}"], "last_assistant_only": [f"ok{end}"],
            "all": [text.removeprefix(hf.decode(encoded.tokens[:1].tolist()))]}
    assert trained_runs(hf, encoded.tokens, encoded.trained) == runs[mask]
    assert encoded.labels()[-1] == -100


def test_byte_special_tokens_are_single_ids():
    tok = ByteTokenizer()
    encoded = ChatEncoder(tok, SFTConfig(template="llama3")).encode(CONVERSATION)
    text = EXPECTED["llama3", False]
    for special in ByteTokenizer.SPECIAL_TOKENS:
        assert (encoded.tokens == tok.token_to_id(special)).sum() == text.count(special)
    assert len(encoded.tokens) == len(text) - sum(text.count(s) * (len(s) - 1) for s in ByteTokenizer.SPECIAL_TOKENS)


@pytest.fixture(scope="module", params=["tiktoken", "sentencepiece"])
def other(request, tmp_path_factory):
    """A tiktoken rank file (the 256 bytes) and a SentencePiece BPE, both with ChatML's tokens as specials that
    their `encode` never produces from text (tiktoken specials, SentencePiece control symbols)."""
    directory = tmp_path_factory.mktemp("other")
    if request.param == "tiktoken":
        ranks = directory / "ranks.tiktoken"
        ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
        specials = {"<|im_start|>": 256, "<|im_end|>": 257, "<|end_of_text|>": 258}
        return TiktokenTokenizer(ranks, special_tokens=specials, eos_token="<|end_of_text|>")
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT), model_writer=buf, vocab_size=340, model_type="bpe",
        character_coverage=1.0, hard_vocab_limit=False, byte_fallback=True, add_dummy_prefix=False,
        control_symbols=["<|im_start|>", "<|im_end|>"], normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2)
    (directory / "sp.model").write_bytes(buf.getvalue())
    return SentencePieceTokenizer(directory / "sp.model")


def test_other_tokenizers_special_tokens_are_single_ids(other):
    encoded = ChatEncoder(other, SFTConfig(template="chatml")).encode(CONVERSATION)
    start, end = other.token_to_id("<|im_start|>"), other.token_to_id("<|im_end|>")
    want: list[int] = []
    for piece in (start, "user\nHi there", end, "\n", start, "assistant\n", "Hello! How can I help?", end, "\n",
                  start, "user\nSay ok.", end, "\n", start, "assistant\n", "ok", end, "\n"):
        want += [piece] if isinstance(piece, int) else other.encode(piece)
    assert encoded.tokens.tolist() == want
    assert encoded.tokens[encoded.trained].tolist() == [*other.encode("Hello! How can I help?"), end,
                                                        *other.encode("ok"), end]


def test_missing_special_token_is_named_with_the_tokenizer(tmp_path):
    path = write_hf(tmp_path / "plain", specials=["<|begin_of_text|>", "<|end_of_text|>"])
    with pytest.raises(ValueError, match=re.escape("'<|im_start|>'")) as err:
        ChatEncoder(HFTokenizer(path), SFTConfig(template="chatml"))
    assert str(path) in str(err.value)
    path = write_hf(tmp_path / "nobos", config={"eos_token": "<|end_of_text|>"})
    with pytest.raises(ValueError, match="BOS") as err:
        ChatEncoder(HFTokenizer(path), SFTConfig(template="gemma"))
    assert str(path) in str(err.value)


# ------------------------------------------------------------------ Jinja templates


def write_template(directory: Path, template: str, **tokens: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": template, **tokens}))
    return path


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("mask", MASKS)
def test_jinja_matches_the_built_in_template_byte(tmp_path, template, mask):
    tok = ByteTokenizer()
    tokens = {"bos_token": "<|begin_of_text|>"} if template == "llama3" else {}  # else: the tokenizer's own BOS
    config = write_template(tmp_path, JINJA[template], **tokens)
    jinja = ChatEncoder(tok, SFTConfig(template="jinja", mask=mask, chat_template_path=str(config)))
    built_in = ChatEncoder(tok, SFTConfig(template=template, mask=mask))
    for messages in (CONVERSATION, [SYSTEM, *CONVERSATION], CONVERSATION[:2]):
        assert jinja.render(messages) == built_in.render(messages)
        a, b = jinja.encode(messages), built_in.encode(messages)
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.trained.tolist() == b.trained.tolist()


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("mask", MASKS)
def test_jinja_matches_the_built_in_template_hf(tmp_path, template, mask):
    path = write_hf(tmp_path / "tok", config={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                               "chat_template": JINJA[template]})
    tok = HFTokenizer(path)
    jinja = ChatEncoder(tok, SFTConfig(template="jinja", mask=mask), tokenizer_path=str(path.parent))
    built_in = ChatEncoder(tok, SFTConfig(template=template, mask=mask))
    messages = [SYSTEM, *CONVERSATION]
    assert jinja.render(messages) == EXPECTED[template, True]
    a, b = jinja.encode(messages), built_in.encode(messages)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.trained.tolist() == b.trained.tolist()


def test_jinja_template_errors_name_the_record(tmp_path):
    config = write_template(tmp_path, GEMMA_JINJA)
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template="jinja", chat_template_path=str(config)))
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                           {"role": "assistant", "content": "c"}]}
    with pytest.raises(InvalidRecord, match="must alternate") as err:
        enc.encode_record(record, "chats.jsonl:7")
    assert str(err.value).startswith("chats.jsonl:7: ") and str(config) in str(err.value)


def test_jinja_template_without_the_prefix_property_is_an_error(tmp_path):
    counted = "{{ messages | length }}" + CHATML_JINJA  # the head changes with every message
    config = write_template(tmp_path, counted)
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template="jinja", chat_template_path=str(tmp_path)))
    with pytest.raises(ChatTemplateError, match="not a prefix") as err:
        enc.encode_record({"messages": CONVERSATION}, "chats.jsonl:3")
    assert str(err.value).startswith("chats.jsonl:3: ") and str(config) in str(err.value)


def test_jinja_needs_a_template(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    with pytest.raises(ValueError, match="no chat_template"):
        ChatEncoder(ByteTokenizer(), SFTConfig(template="jinja", chat_template_path=str(config)))
    with pytest.raises(FileNotFoundError, match="nothere"):
        ChatEncoder(ByteTokenizer(), SFTConfig(template="jinja", chat_template_path=str(tmp_path / "nothere")))
    with pytest.raises(ValueError, match="chat_template_path"):
        ChatEncoder(ByteTokenizer(), SFTConfig(template="jinja"))
    write_template(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                   bos_token="<|nope|>")
    with pytest.raises(ValueError, match=re.escape("'<|nope|>'")):
        ChatEncoder(ByteTokenizer(), SFTConfig(template="jinja", chat_template_path=str(tmp_path)))


# ------------------------------------------------------------------ the marker format


@pytest.fixture(params=["byte", "hf"])
def marked(request, hf) -> ControlTokens:
    return ControlTokens(ByteTokenizer() if request.param == "byte" else hf, MARKERS)


MARKED = ("<<<|user|>>>Translate to Latvian: Good morning<<<|user|>>><<<|assistant|>>>Labrit<<<|assistant|>>>"
          "<<<|user|>>>Hi there<<<|user|>>><<<|assistant|>>>Hello! How can I help?<<<|assistant|>>>")
MARKED_TURNS = [("<|user|>", "Translate to Latvian: Good morning"), ("<|assistant|>", "Labrit"),
                ("<|user|>", "Hi there"), ("<|assistant|>", "Hello! How can I help?")]


@pytest.mark.parametrize("mask", MASKS)
def test_markers_are_special_ids_and_text_between_is_plain(marked, mask):
    inner = marked.inner
    encoded = ChatEncoder(marked, SFTConfig(template="markers", mask=mask)).encode_text(MARKED)
    want_ids: list[int] = []
    want_trained: list[bool] = []
    for i, (special, content) in enumerate(MARKED_TURNS):
        sid = inner.token_to_id(special)
        text = inner.encode(content)
        trains = special == "<|assistant|>" and (mask != "last_assistant_only" or i == 3)
        want_ids += [sid, *text, sid]
        want_trained += [False] + [trains] * (len(text) + 1)
    want_ids.append(inner.eos_id)  # EOS closes the conversation, trained as the last turn is
    want_trained.append(True)
    if mask == "all":
        want_trained = [False] + [True] * (len(want_ids) - 1)
    assert encoded.tokens.tolist() == want_ids
    assert encoded.trained.tolist() == want_trained
    assert encoded.labels().tolist() == shifted(want_ids, np.array(want_trained))


def test_markers_eos_untrained_after_a_user_turn_and_system_prompt():
    tok = ControlTokens(ByteTokenizer(), MARKERS)
    text = "<<<|assistant|>>>ok<<<|assistant|>>><<<|user|>>>x<<<|user|>>>"
    encoded = ChatEncoder(tok, SFTConfig(template="markers", system_prompt="S")).encode_text(text)
    s, a, u = (tok.token_to_id(t) for t in ("<|system|>", "<|assistant|>", "<|user|>"))
    assert encoded.tokens.tolist() == [s, ord("S"), s, a, ord("o"), ord("k"), a, u, ord("x"), u, tok.eos_id]
    assert encoded.trained.tolist() == [False] * 4 + [True] * 3 + [False] * 4


def test_markers_from_messages_and_render():
    tok = ControlTokens(ByteTokenizer(), MARKERS)
    enc = ChatEncoder(tok, SFTConfig(template="markers"))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert enc.render(messages) == "<<<|user|>>>Hi<<<|user|>>><<<|assistant|>>>Yo<<<|assistant|>>>"
    a, b = enc.encode(messages), enc.encode_record({"text": enc.render(messages)}, "x.jsonl:1")
    assert a.tokens.tolist() == b.tokens.tolist() and a.trained.tolist() == b.trained.tolist()


@pytest.mark.parametrize("text, message", [
    ("<<<|user|>>>Hi<<<|user|>>><<<|assistant|>>>Yo", "never closed"),
    ("Hi<<<|user|>>>x<<<|user|>>>", "text outside a marker pair at character 0"),
    ("<<<|user|>>>Hi<<<|user|>>>\n<<<|assistant|>>>Yo<<<|assistant|>>>", "text outside a marker pair at character 26"),
    ("<<<|user|>>>Hi<<<|assistant|>>>", "closed by '<<<|assistant|>>>' at character 14"),
    ("<<<|user|>>>Hi<<<|user|>>><<<|tool|>>>x<<<|tool|>>>", "'<<<|tool|>>>' at character 26 is not in"),
    ("plain text, no markers", "text outside a marker pair"),
    ("<<<|user|>>>Hi<<<|user|>>>", "no 'assistant' turn to train"),
])
def test_malformed_marker_text_is_an_invalid_record(text, message):
    enc = ChatEncoder(ControlTokens(ByteTokenizer(), MARKERS), SFTConfig(template="markers"))
    with pytest.raises(InvalidRecord, match=re.escape(message)) as err:
        enc.encode_record({"text": text}, "sft.jsonl:12")
    assert str(err.value).startswith("sft.jsonl:12: ")


def test_markers_need_control_tokens():
    with pytest.raises(ValueError, match="tokenizer.control_tokens"):
        ChatEncoder(ByteTokenizer(), SFTConfig(template="markers"))
    with pytest.raises(ValueError, match="system marker"):
        ChatEncoder(ControlTokens(ByteTokenizer(), {"<<<|user|>>>": "<|user|>"}),
                    SFTConfig(template="markers", system_prompt="S"))


# ------------------------------------------------------------------ bad conversations


@pytest.mark.parametrize("template, record, message", [
    ("chatml", {"messages": []}, "empty list"),
    ("chatml", {"text": "hello"}, "no field 'messages'"),
    ("chatml", {"messages": [{"role": "user", "content": "hi"}]}, "no 'assistant' turn to train"),
    ("chatml", {"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "a"}]},
     "role 'narrator' is not one of"),
    ("llama3", {"messages": [{"role": "user"}]}, "message 0"),
    ("gemma", {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"},
                            {"role": "assistant", "content": "b"}]}, "system message may only come first"),
    ("gemma", {"messages": [SYSTEM, {"role": "assistant", "content": "b"}]}, "followed by a user message"),
])
def test_bad_conversations_name_the_record(template, record, message):
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template=template))
    with pytest.raises(InvalidRecord, match=re.escape(message)) as err:
        enc.encode_record(record, "data/chats.jsonl:42")
    assert str(err.value).startswith("data/chats.jsonl:42: ")


def test_no_assistant_turn_is_fine_when_training_all():
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template="chatml", mask="all"))
    encoded = enc.encode_record({"messages": json.dumps([{"role": "user", "content": "hi"}])}, "x.parquet: row 0")
    assert encoded.trained.sum() == len(encoded.tokens) - 1


def test_custom_assistant_role():
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template="chatml", assistant_role="gpt"))
    encoded = enc.encode([{"role": "user", "content": "q"}, {"role": "gpt", "content": "a"}])
    assert trained_runs(ByteTokenizer(), encoded.tokens, encoded.trained) == ["a<|im_end|>"]


def test_encoder_pickles_for_worker_processes(tmp_path):
    import pickle

    config = write_template(tmp_path, LLAMA3_JINJA, bos_token="<|begin_of_text|>")
    enc = ChatEncoder(ByteTokenizer(), SFTConfig(template="jinja", mask="last_assistant_only"),
                      tokenizer_path=str(tmp_path / "tokenizer.json"))
    again = pickle.loads(pickle.dumps(enc))
    assert again.sft == enc.sft and config.is_file()
    a, b = enc.encode(CONVERSATION), again.encode(CONVERSATION)
    assert a.tokens.tolist() == b.tokens.tolist() and a.trained.tolist() == b.trained.tolist()
    assert trained_runs(ByteTokenizer(), b.tokens, b.trained) == ["ok<|eot_id|>"]


# ---------------------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("template", [*TEMPLATES, "jinja"])
def test_generation_prompt_is_the_conversation_up_to_the_answer(tmp_path, template):
    """What `generate --chat` feeds the model: the tokens of the conversation before the assistant's content, and
    the end-of-turn id that closes the answer."""
    tok = ByteTokenizer()
    sft = SFTConfig(template=template)
    if template == "jinja":  # a ChatML template with a generation prompt, written by hand
        sft = SFTConfig(template="jinja", chat_template_path=str(write_template(tmp_path, CHATML_JINJA)))
    enc = ChatEncoder(tok, sft)
    question = [{"role": "user", "content": "What is 2+2?"}]
    ids, stop = enc.prompt(question)
    full = enc.encode([*question, {"role": "assistant", "content": "4"}])
    answer = full.tokens[len(ids):].tolist()
    assert full.tokens[:len(ids)].tolist() == ids
    assert answer[0] == ord("4") and full.trained[len(ids)]  # the answer starts right after the prompt
    assert answer[1] in stop  # and its end-of-turn token stops generation
    assert tok.eos_id in stop


def test_markers_generation_prompt_opens_the_assistant_turn(marked):
    enc = ChatEncoder(marked, SFTConfig(template="markers"))
    ids, stop = enc.prompt([{"role": "user", "content": "hi"}])
    user, assistant = marked.marker_ids["<<<|user|>>>"], marked.marker_ids["<<<|assistant|>>>"]
    assert ids == [user, *marked.inner.encode("hi"), user, assistant] and assistant in stop
