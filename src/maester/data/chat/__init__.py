"""Conversations as token ids and a trained mask: chat templates (ChatML, Llama 3, Gemma, a tokenizer's own Jinja
`chat_template`) and the GPT-NeoX marker format. `ChatEncoder` is the one front; each family of formats is one
module: `builtin` (ChatML, Llama 3, Gemma), `jinja`, `markers`, over what they share in `format`.

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

from maester.config import SFTConfig
from maester.data.batch import IGNORE_INDEX
from maester.data.chat.builtin import BuiltinTemplate
from maester.data.chat.format import ChatFormat, Encoded
from maester.data.chat.jinja import ChatTemplateError, JinjaTemplate
from maester.data.chat.markers import MarkerFormat
from maester.data.records import InvalidRecord, messages_of

__all__ = ["IGNORE_INDEX", "ChatEncoder", "ChatTemplateError", "Encoded"]


class ChatEncoder:
    """Turns conversations (or marker text) into `Encoded` rows as `data.sft` says.

    `tokenizer_path` (`tokenizer.path`) is where `jinja` looks for `tokenizer_config.json` when
    `data.sft.chat_template_path` is unset. Every special token the template needs is looked up here, once.
    """

    def __init__(self, tokenizer, sft: SFTConfig, tokenizer_path: str | None = None):
        self.tokenizer = tokenizer
        self.sft = sft
        self.template = sft.template
        self._tokenizer_path = tokenizer_path
        self._format = chat_format(tokenizer, sft, tokenizer_path)

    def __reduce__(self):  # rebuilt where it lands (a compiled Jinja template does not pickle)
        return type(self), (self.tokenizer, self.sft, self._tokenizer_path)

    def render(self, messages: list[dict]) -> str:
        """The whole text `encode` tokenizes (system prompt included), special tokens written as their text; for
        `markers`, the marker text."""
        return self._format.render(self._format.with_system_prompt(_checked(messages)))

    def encode(self, messages: list[dict]) -> Encoded:
        """A conversation's tokens, trained as `data.sft.mask` says; InvalidRecord if it cannot be used."""
        return self._format.encode_messages(self._format.with_system_prompt(_checked(messages)))

    def prompt(self, messages: list[dict]) -> tuple[list[int], set[int]]:
        """Token ids of a conversation followed by the assistant's header (what a chat model continues), and the
        ids that end the assistant's turn (`stop_ids`: stop generating there)."""
        return self._format.prompt_ids(self._format.with_system_prompt(_checked(messages))), self.stop_ids()

    def stop_ids(self) -> set[int]:
        """The ids that end an assistant's answer: EOS and the template's end of turn (for `jinja`, the special
        tokens that follow a probe answer; for `markers`, the assistant marker)."""
        return self._format.stop_ids()

    @property
    def user_role(self) -> str:
        """The role that asks: `user`, or for markers without a user marker, the first other role."""
        return self._format.user_role

    def chat_template(self) -> str:
        """A Jinja `chat_template` that renders conversations as this encoder does, for exported tokenizer files:
        `apply_chat_template` with them gives `encode`'s and `prompt`'s ids."""
        return self._format.chat_template()

    def encode_text(self, text: str) -> Encoded:
        """Marker text (`<<<|user|>>>...<<<|user|>>><<<|assistant|>>>...<<<|assistant|>>>`): marker ids, the text
        between them encoded as plain text, EOS at the end."""
        return self._format.encode_text(text)

    def encode_record(self, record: dict, where: str, text_key: str = "text") -> Encoded:
        """The conversation in a record: `data.sft.messages_key`, or the `text_key` field for `markers`. Bad input
        raises InvalidRecord naming `where`."""
        conversation = self._format.conversation_of(record, where, text_key)
        try:
            return self._format.encode_conversation(conversation)
        except InvalidRecord as e:
            raise InvalidRecord(f"{where}: {e}", e.reason) from None
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{where}: {e}") from None


def chat_format(tokenizer, sft: SFTConfig, tokenizer_path: str | None = None) -> ChatFormat:
    """The format family of `data.sft.template`, chosen once."""
    if sft.template == "markers":
        return MarkerFormat(tokenizer, sft)
    if sft.template == "jinja":
        return JinjaTemplate(tokenizer, sft, tokenizer_path)
    return BuiltinTemplate(tokenizer, sft)


def _checked(messages) -> list[dict]:
    return messages_of({"messages": messages}, "conversation", "messages")
