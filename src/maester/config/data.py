"""The data sections of the config tree: the tokenizer, the data sources, SFT and the data settings of a run
(`data`). Re-exported by the package; `tree` assembles the whole tree."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maester.config.base import Section


class TokenizerConfig(Section):
    kind: Literal["byte", "hf", "sentencepiece", "tiktoken"] = "byte"
    """`byte`: 256 byte values plus special tokens, no files. `hf`: a Hugging Face `tokenizer.json`.
    `sentencepiece`: a SentencePiece `.model` file. `tiktoken`: a local BPE rank file (`<base64 token> <rank>`
    per line, as `cl100k_base.tiktoken` or Llama 3's `tokenizer.model`), or a named encoding (`encoding`)."""
    path: str | None = None
    """For `hf`: a `tokenizer.json` or its directory; else the model / rank file; or a Hub id `org/name[@rev]`."""
    encoding: str | None = None
    """`tiktoken` only, instead of `path`: one of tiktoken's named encodings (`gpt2`, `cl100k_base`, `o200k_base`,
    ...), with its own pattern and special tokens, loaded through tiktoken's cache (`TIKTOKEN_CACHE_DIR`)."""
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    """Special-token strings; for `hf` they default to those in `tokenizer_config.json` beside the file, for
    `sentencepiece` to the model's own BOS/EOS/pad pieces; `tiktoken` has no defaults (EOS is required)."""
    pattern: str | None = None
    """`tiktoken` only: the pre-tokenization regex, or the name of a known one (`gpt2`, `r50k_base`, `p50k_base`,
    `cl100k_base`, `llama3`); None: the cl100k_base pattern (also Llama 3's), with a warning for a rank file that
    is neither cl100k_base's nor Llama 3's size."""
    special_tokens: dict[str, int] = Field(default_factory=dict)
    """`tiktoken` only: special tokens after the ranks, token string -> id, e.g. `{"<|end_of_text|>" = 128001}`."""
    control_tokens: dict[str, str] = Field(default_factory=dict)
    """Marker text -> special-token string, e.g. `{"<<<|user|>>>" = "<|user|>"}`: markers in the text become that
    special token's id, the text between them is tokenized normally; unmapped `<<<|name|>>>` stay text."""

    @model_validator(mode="after")
    def _check_path(self) -> "TokenizerConfig":
        if self.encoding is not None:
            if self.kind != "tiktoken":
                raise ValueError(f"tokenizer.encoding is only used when tokenizer.kind = 'tiktoken' (it is "
                                 f"{self.kind!r})")
            given = [k for k in ("path", "pattern", "special_tokens") if getattr(self, k)]
            if given:
                raise ValueError(f"tokenizer.{given[0]} must not be set with tokenizer.encoding (a named encoding "
                                 f"brings its own file, pattern and special tokens)")
        elif self.kind != "byte" and not self.path:
            raise ValueError(f"tokenizer.path is required when tokenizer.kind = {self.kind!r}"
                             + (" (or tokenizer.encoding, a named encoding)" if self.kind == "tiktoken" else ""))
        if self.kind == "byte":
            given = [k for k in ("path", "bos_token", "eos_token", "pad_token") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"tokenizer.{given[0]} must not be set when tokenizer.kind = 'byte' "
                                 "(its special tokens are fixed)")
        if self.kind != "tiktoken":
            given = [k for k in ("pattern", "special_tokens") if getattr(self, k)]
            if given:
                raise ValueError(f"tokenizer.{given[0]} is only used when tokenizer.kind = 'tiktoken' "
                                 f"(it is {self.kind!r})")
        for name, tid in self.special_tokens.items():
            if not name or tid < 0:
                raise ValueError(f"tokenizer.special_tokens: {name!r} = {tid}: need a non-empty token and an id >= 0")
        for marker, token in self.control_tokens.items():
            if not marker or not token:
                raise ValueError(f"tokenizer.control_tokens: {marker!r} = {token!r}: marker and token must be "
                                 "non-empty")
        return self


class DataSourceConfig(Section):
    path: str
    """Raw text: a Parquet or JSONL file, a directory of them, a glob, a built-in corpus (`builtin:pydoc`), or
    Parquet shards on the Hugging Face Hub, `hf://datasets/org/name[@revision]/<glob or directory>`.
    Pre-tokenized: a Megatron/GPT-NeoX prefix without `.bin`/`.idx`, a glob of llm.c shards, or a nanoGPT bin."""
    name: str | None = None
    """Shown in the per-source metrics; default: the path's last component."""
    format: Literal["auto", "parquet", "jsonl", "txt", "indexed", "llmc", "nanogpt"] = "auto"
    """`auto`: from the suffix (`.parquet`, `.jsonl`, `.txt`), a prefix with `.idx`, or an llm.c header."""
    text_column: str = "text"
    """Raw text only: the column or JSON key holding each document."""
    split_on_blank_lines: bool = False
    """Plain `.txt` files: each paragraph (lines between blank lines) is a document; default: each whole file."""
    label_path: str | None = None
    """SFT from an indexed dataset (`maester data tokenize --template`): the prefix of its label dataset; default:
    the path with `_text_document` replaced by `_label_document`."""
    weight: float = Field(1.0, gt=0)
    """Target share of the training tokens, relative to the other sources' weights."""
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    """Held out of training, always the same part: documents chosen by a hash (raw text), the tail of the
    windows (pre-tokenized)."""

    def display_name(self) -> str:
        if self.name:
            return self.name
        return self.path.removeprefix("builtin:").rstrip("/").rsplit("/", 1)[-1] or self.path


class SFTConfig(Section):
    """How conversations become training rows (`data.mode = "sft"`)."""

    template: Literal["chatml", "llama3", "gemma", "jinja", "markers"] = "chatml"
    """`jinja`: the `chat_template` of `tokenizer_config.json`; `markers`: a text field whose turns are wrapped in
    marker pairs (`<<<|user|>>>...<<<|user|>>>`) that `tokenizer.control_tokens` maps to special tokens."""
    mask: Literal["assistant_only", "all", "last_assistant_only"] = "assistant_only"
    """Which tokens are trained: the assistant turns (their content and end-of-turn token, never role headers),
    every token, or only the last assistant turn."""
    messages_key: str = "messages"
    """The field holding each conversation's [{role, content}] list (or its JSON string); `markers` reads the
    source's `text_column` instead."""
    system_prompt: str | None = None
    """Put this system message first in conversations that have none."""
    chat_template_path: str | None = None
    """`jinja`: a `tokenizer_config.json` (or its directory); default: the one beside `tokenizer.path`."""
    assistant_role: str = "assistant"
    """The role whose turns `assistant_only` / `last_assistant_only` train."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """A conversation longer than `data.seq_len` tokens is cut to fit or left out; either is counted."""


class DataConfig(Section):
    mode: Literal["pretrain", "sft"] = "pretrain"
    """`pretrain`: documents joined and cut into windows; `sft`: conversations (or rows packed by
    `maester data pack`) packed whole into rows, with labels where `data.sft.mask` says."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    sources: list[DataSourceConfig] = Field(
        default_factory=lambda: [DataSourceConfig(path="builtin:pydoc")], min_length=1)
    validation: list[DataSourceConfig] = Field(default_factory=list)
    """Held-out sources that are never trained on, evaluated whole every `logging.eval_interval` steps and logged
    as `val/<name>/loss` and `val/<name>/perplexity` (pretraining; in SFT, use `validation_fraction`)."""
    seq_len: int = Field(512, gt=0)
    add_bos: bool = False
    """Put BOS before every document (EOS always follows one). Raw text only."""
    document_masking: bool = False
    """Attention and positions restart at each document boundary inside a sequence."""
    num_workers: int = Field(1, ge=0)
    """Raw text: DataLoader processes that read and tokenize (0: in the training process); SFT: processes that
    encode the conversations at start. The data does not depend on it."""
    chunk_documents: int = Field(1024, gt=0)
    """Raw text: documents per chunk, the unit that is shuffled and dealt to streams (a Parquet row group is cut
    into chunks of at most this many rows)."""
    skip_invalid: bool = False
    """Raw text: skip (and count, per source, in the metrics) records that are not a non-empty UTF-8 text
    instead of stopping with an error naming the file and row. SFT: also skip conversations (and indexed sequences)
    that train no token."""
    verify_downloads: bool = True
    """Files of a `maester data download` directory are checked against its manifest's sha256 before a run trains
    on them (rank 0, once per file: the job remembers what it checked in `verified-downloads.json`); false: trust
    them as they are."""

    @model_validator(mode="after")
    def _one_kind_of_source(self):
        if self.mode == "sft":
            bad = [f"data.sources.{i}.format" for i, s in enumerate(self.sources) if s.format not in
                   ("auto", "parquet", "jsonl", "txt", "indexed")]
            if bad:
                raise ValueError(f"data.mode = 'sft' reads conversations (JSONL, Parquet, .txt), conversations "
                                 f"tokenized by `maester data tokenize --template` (indexed) or rows packed by "
                                 f"`maester data pack`, not other pre-tokenized formats: {', '.join(bad)}")
        labelled = [f"data.sources.{i}.label_path" for i, s in enumerate(self.sources)
                    if s.label_path is not None and (self.mode != "sft" or s.format not in ("auto", "indexed"))]
        if labelled:
            raise ValueError(f"{', '.join(labelled)}: labels are read only by data.mode = 'sft' from an indexed "
                             f"dataset")
        if self.validation and self.mode == "sft":
            raise ValueError("data.validation: separate validation sources are for pretraining; in SFT, hold out "
                             "part of a source with data.sources.N.validation_fraction")
        for i, s in enumerate(self.validation):
            if s.validation_fraction:
                raise ValueError(f"data.validation.{i}.validation_fraction: a validation source is held out whole; "
                                 f"leave it at 0")
        names = [s.display_name() for s in self.validation]
        if len(set(names)) != len(names):
            raise ValueError(f"data.validation: names {names} repeat; give each source its own `name`")
        kinds = {s.format in ("indexed", "llmc", "nanogpt") for s in self.sources if s.format != "auto"}
        if len(kinds) > 1 and self.mode == "pretrain":
            raise ValueError("data.sources mixes raw text and pre-tokenized formats; use one kind per job")
        return self
