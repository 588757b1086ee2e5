"""A tokenizer's own Jinja `chat_template`, rendered as Hugging Face renders it. An assistant turn's span is what
rendering the turn adds to the render of the turns before it with the generation prompt (GPT-NeoX's prefix diff),
less trailing whitespace."""

from __future__ import annotations

import json
from pathlib import Path

from maester.config import SFTConfig
from maester.data.chat.format import RenderedTemplate, special_text, tokenizer_name
from maester.data.records import INVALID_MESSAGES, InvalidRecord
from maester.data.tokenizers import token_content
from maester.files import read_json_object

# The conversation whose answer shows a template's end of turn.
_PROBE = [{"role": "user", "content": "x"}]


class ChatTemplateError(ValueError):
    """A Jinja chat template whose renders do not extend each other, so the assistant turns cannot be found."""


class JinjaTemplate(RenderedTemplate):
    """`data.sft.template = "jinja"`: the template of `data.sft.chat_template_path`, else of the
    `tokenizer_config.json` beside `tokenizer_path` (`tokenizer.path`)."""

    def __init__(self, tokenizer, sft: SFTConfig, tokenizer_path: str | None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        super().__init__(tokenizer, sft)
        source, origin, config = load_chat_template(sft.chat_template_path, tokenizer_path)
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
        self._variables: dict[str, str] = {}
        for name, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
            if name not in source:
                continue
            text = token_content(config.get(name))
            if text is None and tid is not None:
                text = special_text(tokenizer, tid)
            if text is None:
                raise ValueError(f"chat template {origin} uses {name}, but its tokenizer_config.json does not name "
                                 f"it and tokenizer {tokenizer_name(tokenizer)} has none")
            self._variables[name] = text
        self.find_special_ids(list(self._variables.values()))
        self._stop_ids: set[int] | None = None
        self._source = source
        self._eos_text = self._variables.get("eos_token") or (special_text(tokenizer, tokenizer.eos_id)
                                                              if tokenizer.eos_id is not None else None)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._variables)
        except self._jinja_error as e:
            raise InvalidRecord(f"chat template {self._origin}: {e}", INVALID_MESSAGES) from None

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text, and each assistant turn's span: the render of the turns up to it, less the render of those
        before it with the generation prompt, less trailing whitespace. A template may end the whole conversation
        with EOS (as GPT-NeoX's marker format does): a turn's render that ends in EOS where the whole conversation
        goes on is taken without it."""
        full = self.render(messages)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != self.assistant:
                continue
            before = self.render(messages[:i], True)
            upto = full if i == len(messages) - 1 else self._without_closing_eos(self.render(messages[:i + 1]), full)
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
                                        f"{self.assistant!r} turn")
            spans.append((start, end))
        return full, spans

    def _without_closing_eos(self, upto: str, full: str) -> str:
        eos = self._eos_text
        if eos and upto.endswith(eos) and not full.startswith(upto) and full.startswith(upto[:-len(eos)]):
            return upto[:-len(eos)]
        return upto

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.text_ids(self.render(messages, True))

    def chat_template(self) -> str:
        return self._source

    def stop_ids(self) -> set[int]:
        """EOS and the template's end of turn: the special tokens after the answer of a probe conversation (those
        the template writes, and the tokenizer's own, such as a Hugging Face tokenizer's added special tokens)."""
        if self._stop_ids is None:
            question = self.with_system_prompt(_PROBE)
            answered = self.with_system_prompt([*_PROBE, {"role": self.assistant, "content": "x"}])
            tail = self.encode_messages(answered).tokens.tolist()[len(self.prompt_ids(question)):]
            specials = set(self.special_ids.values()) | set(self.tokenizer.special_tokens().values())
            self._stop_ids = {self.tokenizer.eos_id} | (set(tail) & specials)
        return set(self._stop_ids)


def load_chat_template(chat_template_path: str | None, tokenizer_path: str | None) -> tuple[str, Path, dict]:
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


def _divergence(shorter: str, longer: str) -> str:
    k = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(longer))
    return f"at character {k}: {shorter[k:k + 40]!r} vs {longer[k:k + 40]!r}"


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
