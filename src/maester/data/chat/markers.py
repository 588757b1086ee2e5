"""The GPT-NeoX marker format: `<<<|role|>>>{content}<<<|role|>>>` pairs that `tokenizer.control_tokens` maps to
special tokens. An assistant turn trains its content and its closing marker; EOS is appended, as GPT-NeoX does, and
trained when the last turn is."""

from __future__ import annotations

import re

from maester.config import SFTConfig
from maester.data.chat.format import ChatFormat, Encoded, jinja_string, with_system_prompt_jinja
from maester.data.records import INVALID_MESSAGES, InvalidRecord, text_of
from maester.data.tokenizers import ControlTokens

# Why a marker text is invalid.
MALFORMED_MARKERS = "malformed markers"
_MARKER_SHAPE = r"<<<\|[^|<>\s]+\|>>>"


class MarkerFormat(ChatFormat):
    """`data.sft.template = "markers"`: records hold marker text (a text field), or messages written as marker
    pairs; the text between markers is encoded as plain text by the tokenizer under `ControlTokens`."""

    def __init__(self, tokenizer, sft: SFTConfig):
        super().__init__(tokenizer, sft)
        if not isinstance(tokenizer, ControlTokens):
            raise ValueError("data.sft.template = 'markers' needs tokenizer.control_tokens, the markers and the "
                             "special tokens they stand for, e.g. {\"<<<|user|>>>\" = \"<|user|>\", "
                             "\"<<<|assistant|>>>\" = \"<|assistant|>\"}")
        self._marker_ids = tokenizer.marker_ids
        self._marker_role = {m: _marker_name(m) for m in self._marker_ids}
        self._role_marker = {role: m for m, role in self._marker_role.items()}
        if "user" not in self._role_marker:
            self.user_role = next((r for r in self._role_marker if r not in (self.assistant, "system")), "user")
        if sft.system_prompt is not None and "system" not in self._role_marker:
            raise ValueError("data.sft.system_prompt needs a system marker (<<<|system|>>>) in "
                             "tokenizer.control_tokens")
        ordered = sorted(self._marker_ids, key=len, reverse=True)
        self._marker_split = re.compile("(" + "|".join([*map(re.escape, ordered), _MARKER_SHAPE]) + ")")
        self.text_encoder = tokenizer.inner

    def render(self, messages: list[dict]) -> str:
        """The marker text."""
        return "".join(f"{marker}{content}{marker}" for marker, content in self._turns_of(messages))

    def encode_messages(self, messages: list[dict]) -> Encoded:
        return self.encode_text(self.render(messages))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        assistant = self._assistant_marker()
        ids = []
        for m, content in self._turns_of(messages):
            ids += [self._marker_ids[m], *self.text_encoder.encode(content), self._marker_ids[m]]
        return ids + [self._marker_ids[assistant]]

    def stop_ids(self) -> set[int]:
        return {self._marker_ids[self._assistant_marker()], self.tokenizer.eos_id}

    def encode_text(self, text: str) -> Encoded:
        return self._encode_turns(self._parse_markers(text))

    def chat_template(self) -> str:
        """Each turn between two copies of its role's special token (the token a marker stands for, not the marker
        text), then EOS; with the generation prompt, the assistant's token instead of EOS. The assistant's content,
        closing token and (last) EOS are its `{% generation %}`."""
        q, assistant = jinja_string, self.assistant
        tokens = {role: self.tokenizer.mapping[marker] for marker, role in self._marker_role.items()}
        table = ", ".join(f"{q(role)}: {q(token)}" for role, token in tokens.items())
        return "".join([
            with_system_prompt_jinja(self.sft.system_prompt),
            f"{{%- set tokens = {{{table}}} -%}}\n",
            "{%- for message in conversation -%}\n",
            "{%- if message['role'] not in tokens -%}\n",
            f"{{{{- raise_exception('message ' ~ loop.index0 ~ ': role ' ~ message['role'] ~ "
            f"{q(' has no marker in tokenizer.control_tokens (roles: ' + ', '.join(tokens) + ')')}) -}}}}\n",
            "{%- endif -%}\n",
            "{%- set token = tokens[message['role']] -%}\n",
            f"{{%- if message['role'] == {q(assistant)} -%}}\n",
            "{{- token -}}{%- generation -%}{{- message['content'] + token -}}\n",
            "{%- if loop.last and not add_generation_prompt -%}{{- eos_token -}}{%- endif -%}{%- endgeneration -%}\n",
            "{%- else -%}\n",
            "{{- token + message['content'] + token -}}\n",
            "{%- endif -%}\n",
            "{%- endfor -%}\n",
            f"{{%- if add_generation_prompt -%}}{{{{- tokens[{q(assistant)}] -}}}}\n",
            f"{{%- elif not conversation or conversation[-1]['role'] != {q(assistant)} -%}}{{{{- eos_token -}}}}\n",
            "{%- endif -%}\n"])

    def conversation_of(self, record: dict, where: str, text_key: str) -> str:
        """The record's marker text: its `text_key` field."""
        return text_of(record, where, text_key, self.sft.messages_key)

    def encode_conversation(self, conversation: str) -> Encoded:
        return self.encode_text(conversation)

    def _assistant_marker(self) -> str:
        marker = self._role_marker.get(self.assistant)
        if marker is None:
            raise ValueError(f"no marker for role {self.assistant!r} in tokenizer.control_tokens")
        return marker

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
        trained = self.trained_turns([i for i, (m, _) in enumerate(turns) if self._marker_role[m] == self.assistant])
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
        return self.encode_pieces(pieces, flags)


def _marker_name(marker: str) -> str:
    """The role of a marker: `user` for `<<<|user|>>>`; a marker of another shape is its own role."""
    return marker[4:-4] if re.fullmatch(_MARKER_SHAPE, marker) else marker
