"""Tokenizers behind one small interface: encode, decode, special-token ids and vocabulary size.

Kinds: bytes, a Hugging Face `tokenizer.json`, a SentencePiece `.model`, a tiktoken BPE rank file. `encode` never
adds BOS/EOS (the data pipeline does, explicitly). `ControlTokens` wraps any of them so that markers in the text
(`<<<|user|>>>`) become the ids of real special tokens (`<|user|>`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Protocol

from maester.config import TokenizerConfig

logger = logging.getLogger("maester")

# cl100k_base's pre-tokenization regex (Llama 3 uses the same splits): the default for `tiktoken` rank files.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
# GPT-2's (also r50k_base's and p50k_base's), as tiktoken_ext.openai_public writes it.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
NAMED_PATTERNS = {"gpt2": GPT2_PATTERN, "r50k_base": GPT2_PATTERN, "p50k_base": GPT2_PATTERN,
                  "cl100k_base": CL100K_PATTERN, "llama3": CL100K_PATTERN}
"""`tokenizer.pattern` by name: the pre-tokenizer regex of the rank files of these encodings."""
CL100K_RANKS = (100256, 128000)
"""Rank counts of files the cl100k pattern is right for (cl100k_base's, Llama 3's): no warning without a pattern."""


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def special_tokens(self) -> dict[str, int]:
        """Special-token strings and their ids, so that no caller reaches into a tokenizer's library."""


class ByteTokenizer:
    """The 256 byte values as tokens 0..255, then special tokens; needs no files.

    Besides BOS/EOS/pad, the special tokens of the built-in chat templates (Llama 3, ChatML, Gemma, the marker
    roles) are in the vocabulary, so a byte-level model can be fine-tuned on conversations.
    """

    SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>",
                      "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                      "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>",
                      "<|system|>", "<|user|>", "<|assistant|>")

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

    def token_to_id(self, token: str) -> int | None:
        """The id of one of the special tokens, else None."""
        return 256 + self.SPECIAL_TOKENS.index(token) if token in self.SPECIAL_TOKENS else None

    def special_tokens(self) -> dict[str, int]:
        return {token: 256 + i for i, token in enumerate(self.SPECIAL_TOKENS)}


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

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def special_tokens(self) -> dict[str, int]:
        """The added tokens marked special (`encode` maps their text to their ids itself)."""
        return {token.content: tid for tid, token in self._tok.get_added_tokens_decoder().items() if token.special}


class SentencePieceTokenizer:
    """A SentencePiece `.model` file. BOS/EOS/pad are the model's own unless named in the config.

    `encode` adds no BOS/EOS; control symbols (the model's BOS/EOS, `control_symbols`) are never produced from
    text. User-defined symbols are, by SentencePiece's design: that is what the model was trained to do.
    """

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None):
        import sentencepiece as spm

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"sentencepiece model {path} does not exist")
        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"sentencepiece model {path}: cannot be loaded: {e}") from e
        self.vocab_size = self._sp.get_piece_size()

        def pick(token: str | None, model_id: int) -> int | None:
            if token is not None:
                return self._token_id(token)
            return model_id if model_id >= 0 else None

        self.bos_id = pick(bos_token, self._sp.bos_id())
        eos_id = pick(eos_token, self._sp.eos_id())
        if eos_id is None:
            raise ValueError(f"sentencepiece model {path}: no EOS token (the model has none): "
                             "set tokenizer.eos_token")
        self.eos_id: int = eos_id
        self.pad_id = pick(pad_token, self._sp.pad_id())

    def token_to_id(self, token: str) -> int | None:
        tid = self._sp.piece_to_id(token)
        if tid == self._sp.unk_id() and token != self._sp.id_to_piece(tid):
            return None  # piece_to_id answers unk for pieces it does not know
        return tid

    def _token_id(self, token: str) -> int:
        tid = self.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer {self.path}: special token {token!r} is not in the vocabulary")
        return tid

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int, add_bos=False, add_eos=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int, add_bos=False, add_eos=False)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))

    def special_tokens(self) -> dict[str, int]:
        """The control symbols (never produced from text)."""
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size()) if self._sp.is_control(i)}


class TiktokenTokenizer:
    """A tiktoken BPE built offline from a local rank file (`<base64 token> <rank>` per line).

    `special_tokens` (token -> id) are added after the ranks; BOS/EOS/pad must be among them. Special-token
    text inside ordinary text is encoded as ordinary text, never as the special id.
    """

    def __init__(self, path: str | Path, pattern: str | None = None, special_tokens: dict[str, int] | None = None,
                 bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None):
        import tiktoken

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tiktoken rank file {path} does not exist")
        self.path = path
        ranks = _read_rank_file(path)
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"tiktoken rank file {path}: {len(missing)} of the 256 single bytes have no rank "
                             f"(first: {missing[0]}); every byte needs one")
        special_tokens = dict(special_tokens or {})
        by_id = {rank: token for token, rank in ranks.items()}
        for token, tid in special_tokens.items():
            if tid in by_id:
                raise ValueError(f"tiktoken rank file {path}: special token {token!r} has id {tid}, which is "
                                 f"already the rank of {by_id[tid]!r}")
            by_id[tid] = token
        if eos_token is None:
            raise ValueError(f"tiktoken rank file {path}: no EOS token: set tokenizer.eos_token (and list it "
                             "in tokenizer.special_tokens)")
        if pattern is None and len(ranks) not in CL100K_RANKS:
            logger.warning("tiktoken rank file %s (%d ranks): tokenizer.pattern is unset, so text is split with "
                           "cl100k_base's pre-tokenizer regex (also Llama 3's); a file made for another regex "
                           "tokenizes differently: set tokenizer.pattern to its regex, or a name (%s)", path,
                           len(ranks), ", ".join(NAMED_PATTERNS))
        self._set(tiktoken.Encoding(name=f"maester:{path.name}",
                                    pat_str=NAMED_PATTERNS.get(pattern or "cl100k_base", pattern),
                                    mergeable_ranks=ranks, special_tokens=special_tokens), str(path), special_tokens,
                  bos_token, eos_token, pad_token)

    def _set(self, enc, name: str, special_tokens: dict[str, int], bos_token: str | None, eos_token: str,
             pad_token: str | None) -> None:
        self._enc, self.path, self._special_tokens = enc, name, special_tokens
        self.vocab_size = enc.n_vocab
        self.bos_id = self._token_id(bos_token) if bos_token else None
        self.eos_id = self._token_id(eos_token)
        self.pad_id = self._token_id(pad_token) if pad_token else None

    @classmethod
    def named(cls, encoding: str, bos_token: str | None = None, eos_token: str | None = None,
              pad_token: str | None = None) -> "TiktokenTokenizer":
        """One of tiktoken's named encodings, through its own loader and cache (`TIKTOKEN_CACHE_DIR`), with its
        pattern and special tokens; EOS defaults to `<|endoftext|>`."""
        import tiktoken

        known = tiktoken.list_encoding_names()
        if encoding not in known:
            raise ValueError(f"tokenizer.encoding = {encoding!r} is not a tiktoken encoding; known: "
                             f"{', '.join(known)}")
        try:
            enc = tiktoken.get_encoding(encoding)
        except (OSError, ValueError) as e:  # requests' ConnectionError is an OSError; a bad download a ValueError
            cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
                os.path.join(tempfile.gettempdir(), "data-gym-cache")
            raise ValueError(
                f"tokenizer.encoding = {encoding!r}: not in tiktoken's cache ({cache}) and it could not be "
                f"downloaded ({type(e).__name__}: {str(e).splitlines()[0][:200]}). On a machine with internet run "
                f"`TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('{encoding}')\"`, "
                f"copy DIR here and set TIKTOKEN_CACHE_DIR to it") from None
        specials = {token: enc.encode_single_token(token) for token in sorted(enc.special_tokens_set)}
        tok = cls.__new__(cls)
        tok._set(enc, f"tiktoken:{encoding}", specials, bos_token, eos_token or "<|endoftext|>", pad_token)
        return tok

    def token_to_id(self, token: str) -> int | None:
        return self._special_tokens.get(token)

    def _token_id(self, token: str) -> int:
        tid = self.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer {self.path}: special token {token!r} is not in the vocabulary "
                             f"(tokenizer.special_tokens: {sorted(self._special_tokens)})")
        return tid

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # = encode(text, disallowed_special=()): specials stay text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")

    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)


def _read_rank_file(path: Path) -> dict[bytes, int]:
    """The `<base64 token> <rank>` lines of a tiktoken rank file. (tiktoken's own `load_tiktoken_bpe` caches
    files by path in a temp directory, so an edited local file could be read stale.)"""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"tiktoken rank file {path}, line {n}: expected '<base64 token> <rank>', "
                             f"got {line[:80]!r}") from e
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"tiktoken rank file {path}: ranks are not unique")
    return ranks


class ControlTokens:
    """Any tokenizer, plus markers in the text that become special-token ids.

    `mapping` is marker text -> special-token string (`{"<<<|user|>>>": "<|user|>"}`). `encode` splits the text
    on the markers (longest first), encodes each span between them with the inner tokenizer and puts the special
    token's id at each marker. Text shaped like a marker (`<<<|name|>>>`) but not in the mapping stays ordinary
    text; it is counted in `unknown_markers` (per name) and logged once per new name. `decode` gives the special
    tokens' own text, not the markers.
    """

    UNKNOWN_MARKER = re.compile(r"<<<\|([^|<>\s]+)\|>>>")

    def __init__(self, tokenizer: Tokenizer, mapping: dict[str, str]):
        if not mapping:
            raise ValueError("control tokens: the marker mapping is empty")
        self.inner = tokenizer
        self.mapping = dict(mapping)
        lookup = getattr(tokenizer, "token_to_id", None)
        if lookup is None:
            raise TypeError(f"control tokens: {type(tokenizer).__name__} cannot look up special tokens")
        self.marker_ids: dict[str, int] = {}
        for marker, token in self.mapping.items():
            if not marker:
                raise ValueError("control tokens: a marker is empty")
            tid = lookup(token)
            if tid is None:
                where = getattr(tokenizer, "path", None) or type(tokenizer).__name__
                extra = (f" (its special tokens are only {', '.join(ByteTokenizer.SPECIAL_TOKENS)})"
                         if isinstance(tokenizer, ByteTokenizer) else "")
                raise ValueError(f"control tokens: marker {marker!r} maps to special token {token!r}, which is "
                                 f"not in the vocabulary of tokenizer {where}{extra}")
            self.marker_ids[marker] = tid
        ordered = sorted(self.marker_ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(m) for m in ordered) + ")")
        self.unknown_markers: Counter[str] = Counter()
        self.vocab_size = tokenizer.vocab_size
        self.bos_id = tokenizer.bos_id
        self.eos_id: int = tokenizer.eos_id
        self.pad_id = tokenizer.pad_id

    def __getattr__(self, name: str):  # e.g. `path`; only called for attributes not found on self
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def _pieces(self, text: str) -> list[str | int]:
        """Alternating spans (str) and special ids (int), empty spans dropped."""
        parts = self._split.split(text)
        out: list[str | int] = []
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self.marker_ids[part])
            elif part:
                for name in self.UNKNOWN_MARKER.findall(part):
                    if name not in self.unknown_markers:
                        logger.warning("control tokens: marker <<<|%s|>>> is not in tokenizer.control_tokens; "
                                       "it is tokenized as ordinary text", name)
                    self.unknown_markers[name] += 1
                out.append(part)
        return out

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        pieces = [self._pieces(t) for t in texts]
        spans = [p for ps in pieces for p in ps if isinstance(p, str)]
        encoded = iter(self.inner.encode_batch(spans) if spans else [])
        out = []
        for ps in pieces:
            ids: list[int] = []
            for p in ps:
                if isinstance(p, int):
                    ids.append(p)
                else:
                    ids.extend(next(encoded))
            out.append(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)

    def special_tokens(self) -> dict[str, int]:
        """The inner tokenizer's (markers are not tokens of their own)."""
        return self.inner.special_tokens()


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
    tok: Tokenizer
    if cfg.kind == "byte":
        tok = ByteTokenizer()
    elif cfg.kind == "hf":
        tok = HFTokenizer(tokenizer_path(cfg), cfg.bos_token, cfg.eos_token, cfg.pad_token)
    elif cfg.kind == "sentencepiece":
        tok = SentencePieceTokenizer(tokenizer_path(cfg), cfg.bos_token, cfg.eos_token, cfg.pad_token)
    elif cfg.kind == "tiktoken" and cfg.encoding:
        tok = TiktokenTokenizer.named(cfg.encoding, cfg.bos_token, cfg.eos_token, cfg.pad_token)
    elif cfg.kind == "tiktoken":
        tok = TiktokenTokenizer(tokenizer_path(cfg), cfg.pattern, cfg.special_tokens, cfg.bos_token, cfg.eos_token,
                                cfg.pad_token)
    else:
        raise ValueError(f"tokenizer.kind {cfg.kind!r} is unknown")
    if cfg.control_tokens:
        tok = ControlTokens(tok, cfg.control_tokens)
    return tok


def tokenizer_path(cfg: TokenizerConfig) -> Path:
    """`tokenizer.path` as a local file or directory: a Hub id (`org/name[@revision]`, when no such path exists) is
    fetched into the Hugging Face cache; the kinds that read one file take the repository's `tokenizer.model`."""
    from maester.hub import is_hub_id, local_path

    if cfg.path is None:
        raise ValueError(f"tokenizer.path is not set (tokenizer.kind = {cfg.kind!r})")
    if not is_hub_id(cfg.path):
        return Path(cfg.path)
    directory = local_path(cfg.path, "tokenizer.path", "tokenizer")
    if cfg.kind == "hf":
        return directory
    if not (directory / "tokenizer.model").is_file():
        raise ValueError(f"tokenizer.path = {cfg.path!r}: the Hub repository has no tokenizer.model, which "
                         f"tokenizer.kind = {cfg.kind!r} reads")
    return directory / "tokenizer.model"


def token_content(value) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or an AddedToken `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
