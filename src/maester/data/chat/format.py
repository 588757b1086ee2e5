"""What every chat format shares: the `Encoded` row, the mask over turns, and pieces of text and special ids turned
into tokens. `RenderedTemplate` adds what the chat templates (built-in and Jinja) share: a rendered text cut at
special-token strings and at the assistant turns' character spans."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from maester.config import SFTConfig
from maester.data.batch import IGNORE_INDEX
from maester.data.records import InvalidRecord, messages_of
from maester.data.tokenizers import ControlTokens, HFTokenizer

# Why a conversation is invalid (besides the reasons of `records`).
NOTHING_TO_TRAIN = "nothing to train"


@dataclass
class Encoded:
    """One conversation's tokens, and which of them are loss targets."""

    tokens: np.ndarray  # int64 (n,)
    trained: np.ndarray  # bool (n,): token i is a target (its prediction from position i - 1 is trained)

    def labels(self) -> np.ndarray:
        """Pre-shifted: labels[i] = tokens[i + 1] where that token is trained, else IGNORE_INDEX; the last label is
        always IGNORE_INDEX, so nothing is predicted across two packed conversations."""
        labels = np.full(len(self.tokens), IGNORE_INDEX, dtype=np.int64)
        labels[:-1] = np.where(self.trained[1:], self.tokens[1:], IGNORE_INDEX)
        return labels


class ChatFormat:
    """One way of writing conversations as tokens. `ChatEncoder` checks the messages and adds `data.sft`'s system
    prompt (`with_system_prompt`) before it calls `render`, `encode_messages` or `prompt_ids`."""

    def __init__(self, tokenizer, sft: SFTConfig):
        self.tokenizer = tokenizer
        self.sft = sft
        self.template = sft.template
        self.assistant = sft.assistant_role
        self.user_role = "user"
        self.text_encoder = tokenizer  # what encodes the text between special tokens

    def render(self, messages: list[dict]) -> str:
        """The whole text `encode_messages` tokenizes, special tokens written as their text."""
        raise NotImplementedError

    def encode_messages(self, messages: list[dict]) -> Encoded:
        """A conversation's tokens, trained as `data.sft.mask` says."""
        raise NotImplementedError

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation followed by the assistant's header: what a chat model continues."""
        raise NotImplementedError

    def stop_ids(self) -> set[int]:
        """The ids that end the assistant's turn (and EOS): where generation stops."""
        raise NotImplementedError

    def encode_text(self, text: str) -> Encoded:
        raise ValueError(f"encode_text reads marker text, but data.sft.template = {self.template!r}")

    def chat_template(self) -> str:
        """A Jinja `chat_template` for Hugging Face tokenizer files that renders conversations as this format
        encodes them (its system prompt included): `apply_chat_template` with the exported tokenizer gives these
        ids, `{% generation %}` marks what `assistant_only` trains, and maester reads it back as `jinja`."""
        raise NotImplementedError

    def conversation_of(self, record: dict, where: str, text_key: str) -> list[dict] | str:
        """What `encode_conversation` reads in a record: its `data.sft.messages_key` messages."""
        return messages_of(record, where, self.sft.messages_key, text_key)

    def encode_conversation(self, conversation) -> Encoded:
        return self.encode_messages(self.with_system_prompt(conversation))

    def with_system_prompt(self, messages: list[dict]) -> list[dict]:
        prompt = self.sft.system_prompt
        if prompt is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": prompt}, *messages]

    def trained_turns(self, assistant_turns: list[int]) -> set[int]:
        """Which assistant turns the mask trains; InvalidRecord when there is none to train."""
        if self.sft.mask == "all":
            return set(assistant_turns)
        if not assistant_turns:
            raise InvalidRecord(f"no {self.assistant!r} turn to train (data.sft.mask = {self.sft.mask!r})",
                                NOTHING_TO_TRAIN)
        return set(assistant_turns) if self.sft.mask == "assistant_only" else {assistant_turns[-1]}

    def piece_ids(self, pieces: list[str | int]) -> tuple[list[int], list[int]]:
        """The ids of pieces of text (encoded together in one batch) and special ids, and each piece's length."""
        texts = [p for p in pieces if isinstance(p, str)]
        encoded = iter(self.text_encoder.encode_batch(texts) if texts else ())
        ids: list[int] = []
        lengths: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                piece_ids = next(encoded)
                ids.extend(piece_ids)
                lengths.append(len(piece_ids))
            else:
                ids.append(piece)
                lengths.append(1)
        return ids, lengths

    def encode_pieces(self, pieces: list[str | int], flags: list[bool]) -> Encoded:
        """Pieces of text and special ids, each with its trained flag."""
        ids, lengths = self.piece_ids(pieces)
        tokens = np.array(ids, dtype=np.int64)
        trained = np.repeat(np.array(flags, dtype=bool), lengths)
        if self.sft.mask == "all":
            trained[:] = True
        trained[:1] = False  # nothing comes before the first token
        if self.sft.mask != "all" and not trained.any():
            raise InvalidRecord(f"the {self.assistant!r} turns encode to no tokens", NOTHING_TO_TRAIN)
        return Encoded(tokens, trained)


class RenderedTemplate(ChatFormat):
    """A chat template: the conversation rendered to text with the character spans of its assistant turns. The text
    is cut at those spans and at special-token strings; each special token becomes its single id and each piece of
    text between is encoded on its own (so no token straddles a cut). A subclass renders, and calls
    `find_special_ids` with the special tokens it writes."""

    def find_special_ids(self, required: list[str]) -> None:
        """Looks up each special token in `required` once, plus those the tokenizer's `encode` spells as text."""
        specials = {token: self.special_id(token) for token in required}
        self.special_ids = {**spelled_specials(self.tokenizer), **specials}
        self._special_split = (re.compile("(" + "|".join(map(re.escape, sorted(self.special_ids, key=len,
                                                                                reverse=True))) + ")")
                               if self.special_ids else None)

    def special_id(self, token: str) -> int:
        lookup = getattr(self.tokenizer, "token_to_id", None)
        tid = lookup(token) if lookup else None
        if tid is None:
            raise ValueError(f"data.sft.template = {self.template!r} needs the special token {token!r}, which is "
                             f"not in the vocabulary of tokenizer {tokenizer_name(self.tokenizer)}")
        return tid

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text, and the (start, end) character span of each assistant turn (what it trains)."""
        raise NotImplementedError

    def render(self, messages: list[dict]) -> str:
        return self.spans(messages)[0]

    def encode_messages(self, messages: list[dict]) -> Encoded:
        text, spans = self.spans(messages)
        trained = self.trained_turns(list(range(len(spans))))
        pieces: list[str | int] = []
        flags: list[bool] = []
        pos = 0
        for k, (start, end) in enumerate(spans):
            self.split_specials(text[pos:start], False, pieces, flags)
            self.split_specials(text[start:end], k in trained, pieces, flags)
            pos = end
        self.split_specials(text[pos:], False, pieces, flags)
        return self.encode_pieces(pieces, flags)

    def text_ids(self, text: str) -> list[int]:
        """The ids of a rendered text, cut at special tokens as `encode_messages` cuts it."""
        pieces: list[str | int] = []
        self.split_specials(text, False, pieces, [])
        return self.piece_ids(pieces)[0]

    def split_specials(self, text: str, flag: bool, pieces: list[str | int], flags: list[bool]) -> None:
        """Appends the text's pieces (special tokens as their ids) to `pieces`, and `flag` for each to `flags`."""
        if not text:
            return
        if self._special_split is None:
            pieces.append(text)
            flags.append(flag)
            return
        for k, part in enumerate(self._special_split.split(text)):
            if k % 2:
                pieces.append(self.special_ids[part])
            elif part:
                pieces.append(part)
            else:
                continue
            flags.append(flag)


def jinja_string(text: str) -> str:
    """`text` as a Jinja string literal: printable ASCII as it is, but quotes, backslashes, braces, `%` and `#`
    escaped (none of them can end the literal or the tag around it), newlines and tabs as `\\n` and `\\t`, any other
    character as its code."""
    named = {"\n": "\\n", "\t": "\\t"}
    out = []
    for ch in text:
        code = ord(ch)
        if ch in named:
            out.append(named[ch])
        elif 0x20 <= code < 0x7F and ch not in "\"\\{}%#":
            out.append(ch)
        else:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else
                       f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def with_system_prompt_jinja(system_prompt: str | None) -> str:
    """Jinja that sets `conversation` to the messages, with `system_prompt` first when none is a system message (as
    `ChatFormat.with_system_prompt` does)."""
    if system_prompt is None:
        return "{%- set conversation = messages -%}\n"
    return ("{%- if messages | selectattr('role', 'equalto', 'system') | list -%}\n"
            "{%- set conversation = messages -%}\n"
            "{%- else -%}\n"
            f"{{%- set conversation = [{{'role': 'system', 'content': {jinja_string(system_prompt)}}}] + messages -%}}\n"
            "{%- endif -%}\n")


def base_tokenizer(tokenizer):
    """The tokenizer under `ControlTokens`, else the tokenizer."""
    return tokenizer.inner if isinstance(tokenizer, ControlTokens) else tokenizer


def tokenizer_name(tokenizer) -> str:
    return str(getattr(base_tokenizer(tokenizer), "path", None) or type(base_tokenizer(tokenizer)).__name__)


def spelled_specials(tokenizer) -> dict[str, int]:
    """Special-token strings that the tokenizer's `encode` spells as ordinary text, with their ids: all of its
    special tokens, but none of a Hugging Face tokenizer's, which maps its added tokens in text itself."""
    return {} if isinstance(base_tokenizer(tokenizer), HFTokenizer) else tokenizer.special_tokens()


def special_text(tokenizer, tid: int) -> str | None:
    """The text of a special token id: from the special tokens spelled as text, else its decoding if that maps
    back."""
    for token, i in spelled_specials(tokenizer).items():
        if i == tid:
            return token
    text = tokenizer.decode([tid])
    return text if text and tokenizer.token_to_id(text) == tid else None
