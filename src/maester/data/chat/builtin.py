"""The built-in chat templates, ChatML, Llama 3 and Gemma: each a `Layout` (the text around turns), written by one
`BuiltinTemplate`. An assistant turn's span is its content and its end-of-turn token."""

from __future__ import annotations

from dataclasses import dataclass

from maester.config import SFTConfig
from maester.data.chat.format import (RenderedTemplate, jinja_string, special_text, tokenizer_name,
                                      with_system_prompt_jinja)
from maester.data.records import INVALID_MESSAGES, InvalidRecord


@dataclass(frozen=True)
class Layout:
    """How a built-in template writes a conversation."""

    roles: tuple[str, ...]  # the roles it accepts, besides `data.sft.assistant_role`
    specials: tuple[str, ...]  # the special tokens it writes
    start: str  # the text before the first turn; `{bos}` is the tokenizer's BOS
    header: str  # a turn's header; `{role}` is its role
    end_of_turn: str  # the special token after a turn's content
    separator: str  # the text after a turn
    assistant_name: str | None = None  # the assistant's role in headers (else `data.sft.assistant_role`)
    system_in_first_user_turn: bool = False  # no system turn: a leading system message opens the first user turn


LAYOUTS = {
    "chatml": Layout(("system", "user", "assistant", "tool"), ("<|im_start|>", "<|im_end|>"),
                     "", "<|im_start|>{role}\n", "<|im_end|>", "\n"),
    "llama3": Layout(("system", "user", "assistant", "ipython", "tool"),
                     ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                     "<|begin_of_text|>", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>", ""),
    "gemma": Layout(("system", "user", "assistant"), ("<start_of_turn>", "<end_of_turn>"),
                    "{bos}", "<start_of_turn>{role}\n", "<end_of_turn>", "\n", assistant_name="model",
                    system_in_first_user_turn=True),
}


class BuiltinTemplate(RenderedTemplate):
    """`data.sft.template` = `chatml`, `llama3` or `gemma`."""

    def __init__(self, tokenizer, sft: SFTConfig):
        super().__init__(tokenizer, sft)
        self.layout = LAYOUTS[sft.template]
        required = list(self.layout.specials)
        self._bos = ""
        if "{bos}" in self.layout.start:
            self._bos = self._bos_text()
            required.append(self._bos)
        self._roles = frozenset(self.layout.roles) | {self.assistant}
        self.find_special_ids(required)

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text, and the (start, end) character span of each assistant turn's content and end-of-turn."""
        for i, message in enumerate(messages):
            if message["role"] not in self._roles:
                raise InvalidRecord(f"message {i}: role {message['role']!r} is not one of "
                                    f"{', '.join(sorted(self._roles))} (data.sft.template = {self.template!r})",
                                    INVALID_MESSAGES)
        if self.layout.system_in_first_user_turn:
            messages = self._fold_system(messages)
        parts = [self.layout.start.format(bos=self._bos)]
        size = len(parts[0])
        spans = []
        for message in messages:
            head = self._header(message["role"])
            body = message["content"] + self.layout.end_of_turn
            if message["role"] == self.assistant:
                spans.append((size + len(head), size + len(head) + len(body)))
            parts += (head, body, self.layout.separator)
            size += len(head) + len(body) + len(self.layout.separator)
        return "".join(parts), spans

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.text_ids(self.render(messages) + self._header(self.assistant))

    def stop_ids(self) -> set[int]:
        return {self.special_ids[self.layout.end_of_turn], self.tokenizer.eos_id}

    def chat_template(self) -> str:
        """The layout as Jinja: the same checks of roles (and, for Gemma, of the system message), the same text."""
        layout, assistant, q = self.layout, self.assistant, jinja_string
        roles = sorted(self._roles)
        before, after = layout.header.split("{role}")
        role_in_header = "message['role']" if layout.assistant_name is None else \
            f"({q(layout.assistant_name)} if message['role'] == {q(assistant)} else message['role'])"
        out = [with_system_prompt_jinja(self.sft.system_prompt),
               "{%- for message in conversation -%}\n",
               f"{{%- if message['role'] not in [{', '.join(map(q, roles))}] -%}}\n",
               f"{{{{- raise_exception('message ' ~ loop.index0 ~ ': role ' ~ message['role'] ~ "
               f"{q(' is not one of ' + ', '.join(roles) + f' (data.sft.template = {self.template!r})')}) -}}}}\n",
               "{%- endif -%}\n{%- endfor -%}\n"]
        if layout.system_in_first_user_turn:
            where = f" (data.sft.template = {self.template!r})"
            out += ["{%- for message in conversation[1:] -%}\n",
                    "{%- if message['role'] == 'system' -%}\n",
                    f"{{{{- raise_exception('message ' ~ loop.index ~ "
                    f"{q(': a system message may only come first' + where)}) -}}}}\n",
                    "{%- endif -%}\n{%- endfor -%}\n",
                    "{%- if conversation and conversation[0]['role'] == 'system' -%}\n",
                    "{%- if conversation | length < 2 or conversation[1]['role'] != 'user' -%}\n",
                    f"{{{{- raise_exception({q('message 1: the system message must be followed by a user message' + where)}) -}}}}\n",
                    "{%- endif -%}\n",
                    "{%- set conversation = [{'role': 'user', 'content': conversation[0]['content'] + "
                    f"{q(chr(10) * 2)} + conversation[1]['content']}}] + conversation[2:] -%}}\n",
                    "{%- endif -%}\n"]
        start = layout.start.format(bos="{bos}")
        if start:
            out.append("{{- bos_token -}}\n" if start == "{bos}" else f"{{{{- {q(start)} -}}}}\n")
        out += ["{%- for message in conversation -%}\n",
                f"{{{{- {q(before)} + {role_in_header} + {q(after)} -}}}}\n",
                f"{{%- if message['role'] == {q(assistant)} -%}}\n",
                f"{{%- generation -%}}{{{{- message['content'] + {q(layout.end_of_turn)} -}}}}{{%- endgeneration -%}}\n",
                "{%- else -%}\n",
                f"{{{{- message['content'] + {q(layout.end_of_turn)} -}}}}\n",
                "{%- endif -%}\n"]
        if layout.separator:
            out.append(f"{{{{- {q(layout.separator)} -}}}}\n")
        out += ["{%- endfor -%}\n",
                f"{{%- if add_generation_prompt -%}}{{{{- {q(self._header(assistant))} -}}}}{{%- endif -%}}\n"]
        return "".join(out)

    def _header(self, role: str) -> str:
        if role == self.assistant and self.layout.assistant_name is not None:
            role = self.layout.assistant_name
        return self.layout.header.format(role=role)

    def _bos_text(self) -> str:
        tid = self.tokenizer.bos_id
        text = None if tid is None else special_text(self.tokenizer, tid)
        if text is None:
            raise ValueError(f"data.sft.template = {self.template!r} starts with BOS, but tokenizer "
                             f"{tokenizer_name(self.tokenizer)} has " + ("none: set tokenizer.bos_token" if tid is None
                                                                         else f"no text for BOS id {tid}"))
        return text

    def _fold_system(self, messages: list[dict]) -> list[dict]:
        """A leading system message goes at the head of the first user turn, followed by a blank line."""
        for i, message in enumerate(messages[1:], 1):
            if message["role"] == "system":
                raise InvalidRecord(f"message {i}: a system message may only come first "
                                    f"(data.sft.template = {self.template!r})", INVALID_MESSAGES)
        if messages[0]["role"] != "system":
            return messages
        if len(messages) < 2 or messages[1]["role"] != "user":
            raise InvalidRecord("message 1: the system message must be followed by a user message "
                                f"(data.sft.template = {self.template!r})", INVALID_MESSAGES)
        first = {**messages[1], "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
        return [first, *messages[2:]]
