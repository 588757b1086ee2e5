"""`maester data merge`: several indexed datasets of one dtype into one, with doc_idx merged as Megatron-LM does."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from maester.data.indexed import IndexedDataset, merge_indexed
from maester.tools.data_report import Progress, Summary
from maester.tools.data_tokenize import resolve_indexed_prefix


def merge(prefixes: Sequence[str], output_prefix: str) -> Summary:
    """Concatenate the datasets into `<output_prefix>.bin/.idx`, in the order given. GPT-NeoX merged files
    (doc_idx [0]) count one document per sequence."""
    if not prefixes:
        raise ValueError("merge needs at least one input prefix")
    resolved = [resolve_indexed_prefix(p) for p in prefixes]
    out = os.fspath(output_prefix)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    summary = Summary("merge")
    with Progress("merge", summary) as progress:
        merge_indexed(resolved, out)
        merged = IndexedDataset(out)
        progress.update(merged.num_documents)
    summary.extra = {"inputs": len(resolved), "sequences": len(merged), "tokens": merged.num_tokens,
                     "dtype": merged.dtype.name, "output": f"{out}.bin/.idx"}
    return summary
