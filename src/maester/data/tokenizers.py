"""Tokenizers behind one small interface: encode, decode, special-token ids and vocabulary size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from maester.config import TokenizerConfig


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """The 256 byte values as tokens 0..255, then special tokens; needs no files."""

    SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if 256 <= i < self.vocab_size:
                out.append(self.SPECIAL_TOKENS[i - 256])
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary ({self.vocab_size})")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (fast tokenizer), loaded from a local file or directory.

    Special tokens come from the config, else from `tokenizer_config.json` beside the file. Text is always
    encoded without the tokenizer's own template: BOS/EOS are added by the data pipeline, explicitly.
    """

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file {file} does not exist")
        self.path = file
        self._tok = _Tokenizer.from_file(str(file))
        defaults = _special_tokens_from_tokenizer_config(file.parent / "tokenizer_config.json")
        bos_token = bos_token or defaults.get("bos_token")
        eos_token = eos_token or defaults.get("eos_token")
        pad_token = pad_token or defaults.get("pad_token")
        if eos_token is None:
            raise ValueError(f"tokenizer {file}: no EOS token: set tokenizer.eos_token or provide "
                             f"tokenizer_config.json with eos_token beside it")
        self.bos_id = self._token_id(bos_token) if bos_token else None
        self.eos_id = self._token_id(eos_token)
        self.pad_id = self._token_id(pad_token) if pad_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer {self.path}: special token {token!r} is not in the vocabulary")
        return tid

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _special_tokens_from_tokenizer_config(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = data.get(key)
        if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    if cfg.kind == "byte":
        return ByteTokenizer()
    return HFTokenizer(cfg.path, cfg.bos_token, cfg.eos_token, cfg.pad_token)
