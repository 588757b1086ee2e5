"""Conversations as token ids and a trained mask: chat templates (ChatML, Llama 3, Gemma, a tokenizer's own Jinja
`chat_template`) and the GPT-NeoX marker format.

A conversation is rendered to text together with the character spans of its assistant turns; the text is cut at
those spans and at special-token strings, each special token becomes its single id and each piece of text between
is encoded on its own (so no token straddles a cut). The cuts are the same under every mask, so the tokens do not
depend on `data.sft.mask`. What an assistant turn trains (`assistant_only`), per template:

- ChatML, `<|im_start|>{role}\\n{content}<|im_end|>\\n`: the content and `<|im_end|>`.
- Llama 3, `<|begin_of_text|>` then `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`: the
  content and `<|eot_id|>`.
- Gemma, BOS then `<start_of_turn>{role}\\n{content}<end_of_turn>\\n` (the assistant role written `model`; a system
  message goes at the head of the first user turn, followed by a blank line): the content and `<end_of_turn>`.
- Jinja: what rendering the turn adds to the render of the turns before it with the generation prompt (GPT-NeoX's
  prefix diff), less trailing whitespace. For the templates above this is exactly the built-in's span.
- Markers, `<<<|role|>>>{content}<<<|role|>>>` pairs that `tokenizer.control_tokens` maps to special tokens: the
  content and the closing marker. EOS is appended, as GPT-NeoX does, and trained when the last turn is.

Role headers, the generation prompt and the separators between turns are never trained; `last_assistant_only`
trains the last assistant turn only; `all` trains every token but the first. Chat templates get no EOS appended:
their end-of-turn token is where generation stops. Content is written verbatim (not trimmed); special-token text
inside it becomes the special token, as with Hugging Face's `apply_chat_template(tokenize=True)`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from maester.config import SFTConfig
from maester.data.batch import IGNORE_INDEX
from maester.data.records import INVALID_MESSAGES, InvalidRecord, messages_of, text_of
from maester.data.tokenizers import (ByteTokenizer, ControlTokens, HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer,
                                     token_content)
from maester.files import read_json_object

__all__ = ["IGNORE_INDEX", "ChatEncoder", "ChatTemplateError", "Encoded"]

# Reasons a conversation is invalid (besides those of `records`).
NOTHING_TO_TRAIN = "nothing to train"
MALFORMED_MARKERS = "malformed markers"

# Roles each built-in template accepts, besides `data.sft.assistant_role`.
ROLES = {
    "chatml": ("system", "user", "assistant", "tool"),
    "llama3": ("system", "user", "assistant", "ipython", "tool"),
    "gemma": ("system", "user", "assistant"),
}
# Built-in templates: text before the first turn, a turn's header, its end-of-turn token, the separator after it.
_LAYOUTS = {
    "chatml": ("", "<|im_start|>{role}\n", "<|im_end|>", "\n"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>", ""),
    "gemma": ("{bos}", "<start_of_turn>{role}\n", "<end_of_turn>", "\n"),
}
_SPECIALS = {"chatml": ("<|im_start|>", "<|im_end|>"),
             "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
             "gemma": ("<start_of_turn>", "<end_of_turn>")}
_MARKER_SHAPE = r"<<<\|[^|<>\s]+\|>>>"


class ChatTemplateError(ValueError):
    """A Jinja chat template whose renders do not extend each other, so the assistant turns cannot be found."""


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


class ChatEncoder:
    """Turns conversations (or marker text) into `Encoded` rows as `data.sft` says.

    `tokenizer_path` (`tokenizer.path`) is where `jinja` looks for `tokenizer_config.json` when
    `data.sft.chat_template_path` is unset. Every special token the template needs is looked up here, once.
    """

    def __init__(self, tokenizer, sft: SFTConfig, tokenizer_path: str | None = None):
        self.tokenizer = tokenizer
        self.sft = sft
        self._tokenizer_path = tokenizer_path
        self.template = sft.template
        self._assistant = sft.assistant_role
        self._text_encoder = tokenizer
        required: list[str] = []
        if sft.template == "markers":
            self._init_markers()
        elif sft.template == "jinja":
            required = self._init_jinja(tokenizer_path)
        else:
            required = list(_SPECIALS[sft.template])
            self._bos = ""
            if sft.template == "gemma":
                self._bos = self._bos_text()
                required.append(self._bos)
            self._roles = frozenset(ROLES[sft.template]) | {self._assistant}
        specials = {token: self._special_id(token) for token in required}
        if sft.template != "markers" and not isinstance(_base(tokenizer), HFTokenizer):
            specials = {**_special_vocab(tokenizer), **specials}  # HF maps its added tokens in text itself
        self._special_ids = specials
        self._special_split = (re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True)))
                                          + ")") if specials else None)

    def __reduce__(self):  # rebuilt where it lands (a compiled Jinja template does not pickle)
        return type(self), (self.tokenizer, self.sft, self._tokenizer_path)

    # --- public ---------------------------------------------------------------------------------------------------

    def render(self, messages: list[dict]) -> str:
        """The whole text `encode` tokenizes (system prompt included), special tokens written as their text; for
        `markers`, the marker text."""
        messages = self._with_system_prompt(_checked(messages))
        if self.template == "markers":
            return "".join(f"{marker}{content}{marker}" for marker, content in self._turns_of(messages))
        if self.template == "jinja":
            return self._render_jinja(messages, False)
        return self._render_builtin(messages)[0]

    def encode(self, messages: list[dict]) -> Encoded:
        """A conversation's tokens, trained as `data.sft.mask` says; InvalidRecord if it cannot be used."""
        return self._encode_messages(_checked(messages))

    def prompt(self, messages: list[dict]) -> tuple[list[int], set[int]]:
        """Token ids of a conversation followed by the assistant's header (what a chat model continues), and the
        ids that end the assistant's turn (stop generating there)."""
        messages = self._with_system_prompt(_checked(messages))
        if self.template == "markers":
            marker = self._role_marker.get(self._assistant)
            if marker is None:
                raise ValueError(f"no marker for role {self._assistant!r} in tokenizer.control_tokens")
            ids = []
            for m, content in self._turns_of(messages):
                ids += [self._marker_ids[m], *self._text_encoder.encode(content), self._marker_ids[m]]
            return ids + [self._marker_ids[marker]], {self._marker_ids[marker], self.tokenizer.eos_id}
        if self.template == "jinja":
            text = self._render_jinja(messages, True)
            stop = {self.tokenizer.eos_id}
        else:
            text = self._render_builtin(messages)[0]
            before, header, end_of_turn, _ = _LAYOUTS[self.template]
            text += header.format(role="model" if self.template == "gemma" else self._assistant)
            stop = {self._special_ids[end_of_turn], self.tokenizer.eos_id}
        pieces: list[str | int] = []
        flags: list[bool] = []
        self._split_specials(text, False, pieces, flags)
        ids, _ = self._piece_ids(pieces)
        if self.template == "jinja":  # the template's end of turn: the special tokens after a probe answer
            probe = self.encode([*messages, {"role": self._assistant, "content": "x"}]).tokens.tolist()
            stop |= set(probe[len(ids):]) & set(self._special_ids.values())
        return ids, stop

    def encode_text(self, text: str) -> Encoded:
        """Marker text (`<<<|user|>>>...<<<|user|>>><<<|assistant|>>>...<<<|assistant|>>>`): marker ids, the text
        between them encoded as plain text, EOS at the end."""
        if self.template != "markers":
            raise ValueError(f"encode_text reads marker text, but data.sft.template = {self.template!r}")
        return self._encode_turns(self._parse_markers(text))

    def encode_record(self, record: dict, where: str, text_key: str = "text") -> Encoded:
        """The conversation in a record: `data.sft.messages_key`, or the `text_key` field for `markers`. Bad input
        raises InvalidRecord naming `where`."""
        if self.template == "markers":
            text = text_of(record, where, text_key, self.sft.messages_key)
        else:
            messages = messages_of(record, where, self.sft.messages_key, text_key)
        try:
            return self.encode_text(text) if self.template == "markers" else self._encode_messages(messages)
        except InvalidRecord as e:
            raise InvalidRecord(f"{where}: {e}", e.reason) from None
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{where}: {e}") from None

    # --- shared -----------------------------------------------------------------------------------------------------

    def _special_id(self, token: str) -> int:
        lookup = getattr(self.tokenizer, "token_to_id", None)
        tid = lookup(token) if lookup else None
        if tid is None:
            raise ValueError(f"data.sft.template = {self.template!r} needs the special token {token!r}, which is "
                             f"not in the vocabulary of tokenizer {_name(self.tokenizer)}")
        return tid

    def _special_text(self, tid: int) -> str | None:
        """The text of a special token id: from the special vocabulary, else its decoding if that maps back."""
        for token, i in _special_vocab(self.tokenizer).items():
            if i == tid:
                return token
        text = self.tokenizer.decode([tid])
        return text if text and self.tokenizer.token_to_id(text) == tid else None

    def _bos_text(self) -> str:
        tid = self.tokenizer.bos_id
        text = None if tid is None else self._special_text(tid)
        if text is None:
            raise ValueError(f"data.sft.template = {self.template!r} starts with BOS, but tokenizer "
                             f"{_name(self.tokenizer)} has " + ("none: set tokenizer.bos_token" if tid is None
                                                                else f"no text for BOS id {tid}"))
        return text

    def _with_system_prompt(self, messages: list[dict]) -> list[dict]:
        prompt = self.sft.system_prompt
        if prompt is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": prompt}, *messages]

    def _trained_turns(self, assistant_turns: list[int]) -> set[int]:
        """Which assistant turns the mask trains; InvalidRecord when there is none to train."""
        if self.sft.mask == "all":
            return set(assistant_turns)
        if not assistant_turns:
            raise InvalidRecord(f"no {self._assistant!r} turn to train (data.sft.mask = {self.sft.mask!r})",
                                NOTHING_TO_TRAIN)
        return set(assistant_turns) if self.sft.mask == "assistant_only" else {assistant_turns[-1]}

    def _piece_ids(self, pieces: list[str | int]) -> tuple[list[int], list[int]]:
        """The ids of pieces of text (encoded together in one batch) and special ids, and each piece's length."""
        texts = [p for p in pieces if isinstance(p, str)]
        encoded = iter(self._text_encoder.encode_batch(texts) if texts else ())
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

    def _encode_pieces(self, pieces: list[str | int], flags: list[bool]) -> Encoded:
        """Pieces of text and special ids, each with its trained flag."""
        ids, lengths = self._piece_ids(pieces)
        tokens = np.array(ids, dtype=np.int64)
        trained = np.repeat(np.array(flags, dtype=bool), lengths)
        if self.sft.mask == "all":
            trained[:] = True
        trained[:1] = False  # nothing comes before the first token
        if self.sft.mask != "all" and not trained.any():
            raise InvalidRecord(f"the {self._assistant!r} turns encode to no tokens", NOTHING_TO_TRAIN)
        return Encoded(tokens, trained)

    # --- chat templates -----------------------------------------------------------------------------------------

    def _encode_messages(self, messages: list[dict]) -> Encoded:
        if self.template == "markers":
            return self.encode_text(self.render(messages))
        messages = self._with_system_prompt(messages)
        if self.template == "jinja":
            text = self._render_jinja(messages, False)
            spans = self._jinja_spans(messages, text)
        else:
            text, spans = self._render_builtin(messages)
        trained = self._trained_turns(list(range(len(spans))))
        pieces: list[str | int] = []
        flags: list[bool] = []
        pos = 0
        for k, (start, end) in enumerate(spans):
            self._split_specials(text[pos:start], False, pieces, flags)
            self._split_specials(text[start:end], k in trained, pieces, flags)
            pos = end
        self._split_specials(text[pos:], False, pieces, flags)
        return self._encode_pieces(pieces, flags)

    def _split_specials(self, text: str, flag: bool, pieces: list[str | int], flags: list[bool]) -> None:
        if not text:
            return
        if self._special_split is None:
            pieces.append(text)
            flags.append(flag)
            return
        for k, part in enumerate(self._special_split.split(text)):
            if k % 2:
                pieces.append(self._special_ids[part])
            elif part:
                pieces.append(part)
            else:
                continue
            flags.append(flag)

    def _render_builtin(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text, and the (start, end) character span of each assistant turn's content and end-of-turn."""
        for i, message in enumerate(messages):
            if message["role"] not in self._roles:
                raise InvalidRecord(f"message {i}: role {message['role']!r} is not one of "
                                    f"{', '.join(sorted(self._roles))} (data.sft.template = {self.template!r})",
                                    INVALID_MESSAGES)
        if self.template == "gemma":
            messages = _gemma_fold_system(messages)
        before, header, end_of_turn, separator = _LAYOUTS[self.template]
        parts = [before.format(bos=self._bos)]
        size = len(parts[0])
        spans = []
        for message in messages:
            role = message["role"]
            if self.template == "gemma" and role == self._assistant:
                role = "model"
            head = header.format(role=role)
            body = message["content"] + end_of_turn
            if message["role"] == self._assistant:
                spans.append((size + len(head), size + len(head) + len(body)))
            parts += (head, body, separator)
            size += len(head) + len(body) + len(separator)
        return "".join(parts), spans

    # --- jinja --------------------------------------------------------------------------------------------------

    def _init_jinja(self, tokenizer_path: str | None) -> list[str]:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source, origin, config = _load_chat_template(self.sft.chat_template_path, tokenizer_path)
        self._origin = origin
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_block(), "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        # No `strftime_now`: templates that date their system prompt fall back to a fixed date, so data is stable.
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template {origin}: line {e.lineno}: {e.message}") from None
        self._jinja_error = jinja2.TemplateError
        self._jinja_vars: dict[str, str] = {}
        for name, tid in (("bos_token", self.tokenizer.bos_id), ("eos_token", self.tokenizer.eos_id)):
            if name not in source:
                continue
            text = token_content(config.get(name))
            if text is None and tid is not None:
                text = self._special_text(tid)
            if text is None:
                raise ValueError(f"chat template {origin} uses {name}, but its tokenizer_config.json does not name "
                                 f"it and tokenizer {_name(self.tokenizer)} has none")
            self._jinja_vars[name] = text
        return list(self._jinja_vars.values())

    def _render_jinja(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._jinja_vars)
        except self._jinja_error as e:
            raise InvalidRecord(f"chat template {self._origin}: {e}", INVALID_MESSAGES) from None

    def _jinja_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        """Each assistant turn's span: the render of the turns up to it, less the render of those before it with
        the generation prompt, less trailing whitespace."""
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != self._assistant:
                continue
            before = self._render_jinja(messages[:i], True)
            upto = full if i == len(messages) - 1 else self._render_jinja(messages[:i + 1], False)
            for shorter, longer, what in ((before, upto, f"{i} messages with the generation prompt"),
                                          (upto, full, f"{i + 1} messages")):
                if not longer.startswith(shorter):
                    raise ChatTemplateError(
                        f"chat template {self._origin}: the render of the first {what} is not a prefix of the "
                        f"render of the {'next message' if shorter is before else 'whole conversation'} "
                        f"({_divergence(shorter, longer)}), so the trained tokens of message {i} cannot be found")
            start, end = len(before), len(upto)
            while end > start and upto[end - 1].isspace():
                end -= 1
            if spans and start < spans[-1][1]:
                raise ChatTemplateError(f"chat template {self._origin}: message {i} starts inside the previous "
                                        f"{self._assistant!r} turn")
            spans.append((start, end))
        return spans

    # --- markers ------------------------------------------------------------------------------------------------

    def _init_markers(self) -> None:
        if not isinstance(self.tokenizer, ControlTokens):
            raise ValueError("data.sft.template = 'markers' needs tokenizer.control_tokens, the markers and the "
                             "special tokens they stand for, e.g. {\"<<<|user|>>>\" = \"<|user|>\", "
                             "\"<<<|assistant|>>>\" = \"<|assistant|>\"}")
        self._marker_ids = self.tokenizer.marker_ids
        self._marker_role = {m: _marker_name(m) for m in self._marker_ids}
        self._role_marker = {role: m for m, role in self._marker_role.items()}
        if self.sft.system_prompt is not None and "system" not in self._role_marker:
            raise ValueError("data.sft.system_prompt needs a system marker (<<<|system|>>>) in "
                             "tokenizer.control_tokens")
        ordered = sorted(self._marker_ids, key=len, reverse=True)
        self._marker_split = re.compile("(" + "|".join([*map(re.escape, ordered), _MARKER_SHAPE]) + ")")
        self._text_encoder = self.tokenizer.inner  # the text between markers is plain text

    def _turns_of(self, messages: list[dict]) -> list[tuple[str, str]]:
        turns = []
        for i, message in enumerate(messages):
            marker = self._role_marker.get(message["role"])
            if marker is None:
                raise InvalidRecord(f"message {i}: role {message['role']!r} has no marker in tokenizer.control_tokens "
                                    f"(roles: {', '.join(self._role_marker)})", INVALID_MESSAGES)
            turns.append((marker, message["content"]))
        return turns

    def _parse_markers(self, text: str) -> list[tuple[str, str]]:
        """(marker, content) of each pair; InvalidRecord if the text is not a sequence of closed pairs."""
        parts = self._marker_split.split(text)

        def bad(message: str) -> InvalidRecord:
            return InvalidRecord(message, MALFORMED_MARKERS)

        def known(marker: str, pos: int) -> str:
            if marker not in self._marker_ids:
                raise bad(f"marker {marker!r} at character {pos} is not in tokenizer.control_tokens "
                          f"({', '.join(self._marker_ids)})")
            return marker

        if parts[0]:
            raise bad(f"text outside a marker pair at character 0: {parts[0][:40]!r}")
        turns = []
        pos = 0
        for k in range(1, len(parts), 4):
            opening = known(parts[k], pos)
            if k + 2 >= len(parts):
                raise bad(f"marker {opening!r} at character {pos} is never closed")
            content = parts[k + 1]
            close_pos = pos + len(opening) + len(content)
            closing = known(parts[k + 2], close_pos)
            if closing != opening:
                raise bad(f"marker {opening!r} at character {pos} is closed by {closing!r} at character "
                          f"{close_pos}")
            pos = close_pos + len(closing)
            if parts[k + 3]:
                raise bad(f"text outside a marker pair at character {pos}: {parts[k + 3][:40]!r}")
            turns.append((opening, content))
        if not turns:
            raise bad("no marker pairs in the text")
        return turns

    def _encode_turns(self, turns: list[tuple[str, str]]) -> Encoded:
        if self.sft.system_prompt is not None and all(self._marker_role[m] != "system" for m, _ in turns):
            turns = [(self._role_marker["system"], self.sft.system_prompt), *turns]
        trained = self._trained_turns([i for i, (m, _) in enumerate(turns) if self._marker_role[m] == self._assistant])
        pieces: list[str | int] = []
        flags: list[bool] = []
        for i, (marker, content) in enumerate(turns):
            flag = i in trained
            pieces.append(self._marker_ids[marker])
            flags.append(False)
            if content:
                pieces.append(content)
                flags.append(flag)
            pieces.append(self._marker_ids[marker])
            flags.append(flag)
        pieces.append(self.tokenizer.eos_id)
        flags.append(len(turns) - 1 in trained)
        return self._encode_pieces(pieces, flags)


# --- helpers ----------------------------------------------------------------------------------------------------------

def _base(tokenizer):
    return tokenizer.inner if isinstance(tokenizer, ControlTokens) else tokenizer


def _name(tokenizer) -> str:
    return str(getattr(_base(tokenizer), "path", None) or type(_base(tokenizer)).__name__)


def _special_vocab(tokenizer) -> dict[str, int]:
    """Special-token strings that the tokenizer's `encode` spells as ordinary text, with their ids. (A Hugging Face
    tokenizer maps its added tokens in text itself.)"""
    base = _base(tokenizer)
    if isinstance(base, ByteTokenizer):
        return {token: 256 + i for i, token in enumerate(base.SPECIAL_TOKENS)}
    if isinstance(base, TiktokenTokenizer):
        return dict(base.special_tokens)
    if isinstance(base, SentencePieceTokenizer):
        sp = base._sp
        return {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i)}
    return {}


def _checked(messages) -> list[dict]:
    return messages_of({"messages": messages}, "conversation", "messages")


def _gemma_fold_system(messages: list[dict]) -> list[dict]:
    """Gemma has no system turn: a leading system message goes at the head of the first user turn."""
    for i, message in enumerate(messages[1:], 1):
        if message["role"] == "system":
            raise InvalidRecord(f"message {i}: a system message may only come first (data.sft.template = 'gemma')",
                                INVALID_MESSAGES)
    if messages[0]["role"] != "system":
        return messages
    if len(messages) < 2 or messages[1]["role"] != "user":
        raise InvalidRecord("message 1: the system message must be followed by a user message "
                            "(data.sft.template = 'gemma')", INVALID_MESSAGES)
    first = {**messages[1], "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
    return [first, *messages[2:]]


def _marker_name(marker: str) -> str:
    """The role of a marker: `user` for `<<<|user|>>>`; a marker of another shape is its own role."""
    return marker[4:-4] if re.fullmatch(_MARKER_SHAPE, marker) else marker


def _divergence(shorter: str, longer: str) -> str:
    k = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(longer))
    return f"at character {k}: {shorter[k:k + 40]!r} vs {longer[k:k + 40]!r}"


def _load_chat_template(chat_template_path: str | None, tokenizer_path: str | None) -> tuple[str, Path, dict]:
    """(template source, the file it came from, the tokenizer_config.json beside it or {})."""
    if chat_template_path:
        path = Path(chat_template_path)
        file = path / "tokenizer_config.json" if path.is_dir() else path
    elif tokenizer_path:
        path = Path(tokenizer_path)
        file = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    else:
        raise ValueError("data.sft.template = 'jinja' needs data.sft.chat_template_path (a tokenizer_config.json) "
                         "or a tokenizer.path with tokenizer_config.json beside it")
    if not file.is_file():
        raise FileNotFoundError(f"data.sft.template = 'jinja': {file} does not exist")
    if file.suffix == ".jinja":  # a bare template file, as newer Hugging Face repos ship it
        beside = file.parent / "tokenizer_config.json"
        return file.read_text(), file, read_json_object(beside) if beside.is_file() else {}
    config = read_json_object(file)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ValueError(f"{file}: chat_template holds named templates ({', '.join(map(str, named))}) but "
                             f"none named 'default'")
    if template is None:
        jinja_file = file.parent / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(), jinja_file, config
        raise ValueError(f"{file}: no chat_template (and no chat_template.jinja beside it)")
    if not isinstance(template, str):
        raise ValueError(f"{file}: chat_template is a {type(template).__name__}, not a template string")
    return template, file, config


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Hugging Face's `tojson`: plain `json.dumps`, without Jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _generation_block():
    """Hugging Face's `{% generation %}...{% endgeneration %}` tag, rendered as its body: the trained spans come
    from prefix diffs here, so templates written for either way work."""
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationBlock
