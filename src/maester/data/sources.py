"""The files a data source reads, found as its loader finds them: its format (told by the config or by the path),
the files of a pre-tokenized source, and `check_source`, which opens a source's files the way training will, for a
check before a job is submitted (`maester submit`)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

from maester.config import DataSourceConfig
from maester.data.indexed import LLMC_MAGIC

PRETOKENIZED = ("indexed", "llmc", "nanogpt")


def source_format(cfg: DataSourceConfig) -> str:
    """The format of a source: as configured, or told by its path (suffix, `.idx` beside it, llm.c header)."""
    if cfg.format != "auto":
        return cfg.format
    path = cfg.path
    if path.startswith("builtin:") or Path(path).is_dir():
        return "text"
    if Path(path + ".idx").is_file():
        return "indexed"
    first = sorted(glob.glob(path)) if any(ch in path for ch in "*?[") else [path]
    if first and first[0].endswith(".bin") and Path(first[0]).is_file():
        header = np.fromfile(first[0], dtype="<i4", count=1)
        if len(header) and int(header[0]) == LLMC_MAGIC:
            return "llmc"
        raise ValueError(f"data source {path!r}: {first[0]} has no llm.c header; set format = 'nanogpt' for a raw "
                         f"nanoGPT bin, or give an indexed dataset's prefix without .bin")
    return "text"


def shard_files(cfg: DataSourceConfig) -> list[Path]:
    """The files of an llm.c or nanoGPT source: a file, or a glob's matches (sorted)."""
    matches = sorted(glob.glob(cfg.path)) if any(ch in cfg.path for ch in "*?[") else [cfg.path]
    if not matches or not all(os.path.isfile(m) for m in matches):
        raise FileNotFoundError(f"data source {cfg.path!r} matches no file")
    return [Path(m) for m in matches]


def check_source(cfg: DataSourceConfig, mode: str) -> None:
    """Open the files of source `cfg` as a run in data mode `mode` (`pretrain`, `sft`) will: an indexed dataset's
    index (and, in SFT, its label dataset beside it), llm.c or nanoGPT shards, raw text files (on the Hub too);
    raises what training would raise on missing or unreadable files."""
    fmt = source_format(cfg)
    if fmt == "indexed":
        from maester.data.indexed import IndexedDataset

        if mode == "sft":
            from maester.data.sft_indexed import label_prefix_of, open_pair

            open_pair(cfg.path, cfg.label_path or label_prefix_of(cfg.path))
        else:
            IndexedDataset(cfg.path)
    elif fmt in PRETOKENIZED:
        shard_files(cfg)
    else:
        from maester.data.text_files import resolve_files

        resolve_files(cfg)


def local_files(cfg: DataSourceConfig) -> list[Path]:
    """The local files source `cfg` reads (none for a built-in corpus or a source on the Hub)."""
    from maester.data.hub_datasets import is_hub_source

    if cfg.path.startswith("builtin:") or is_hub_source(cfg.path):
        return []
    fmt = source_format(cfg)
    if fmt == "indexed":
        return [Path(f"{cfg.path}.{ext}") for ext in ("idx", "bin")]
    if fmt in PRETOKENIZED:
        return shard_files(cfg)
    from maester.data.text_files import resolve_files

    return [f for f in resolve_files(cfg) if isinstance(f, Path)]
