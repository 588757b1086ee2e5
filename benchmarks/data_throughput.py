"""Data pipeline throughput: tokens/s of offline tokenizing and of both training loaders, on one machine.

    uv run python benchmarks/data_throughput.py            # about 20 MB of text, a 16k BPE tokenizer
    uv run python benchmarks/data_throughput.py --smoke    # a small corpus (run by the tests)

The corpus is the built-in one (Python's own documentation) repeated to the requested size and written as
Parquet with row groups of 1,024 documents; the tokenizer is a byte-level BPE trained on it here, so nothing is
downloaded. Rows, each measured in this one process against its own baseline where there is one:

  tokenize       `maester data tokenize` to .bin/.idx with 1 and 2 workers, against a naive loop that reads the
                 Parquet column, encodes one document at a time and writes it (the ratio is the speed-up);
                 the outputs are checked to be identical
  text loader    the on-the-fly Parquet loader (read, tokenize, mix, cut windows) in the training process
                 (= one DataLoader worker's work), from construction over two epochs' worth of steps
  indexed loader the pre-tokenized loader over the .bin/.idx just written (mmap, permuted windows)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_corpus(out: Path, target_mb: float) -> tuple[Path, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from maester.data.builtin_corpora import pydoc_documents

    base = pydoc_documents()
    docs, size, copy = [], 0, 0
    while size < target_mb * 1e6:
        for d in base:
            text = f"[{copy}] {d}"
            docs.append(text)
            size += len(text.encode())
        copy += 1
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs}), out / "corpus.parquet", row_group_size=1024)
    return out, docs


def train_bpe(docs: list[str], path: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs[:4000], trainer)
    tok.save(str(path))
    return path


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a small corpus, to check the harness")
    parser.add_argument("--mb", type=float, default=20.0, help="corpus size in MB of text")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.vocab, args.seq_len = 1.0, 1024, 256
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: tokens/s per worker

    import numpy as np

    from maester.config import DataConfig, DataSourceConfig, TokenizerConfig
    from maester.data.batch import BatchPlan
    from maester.data.indexed import IndexedDataset, IndexedDatasetWriter
    from maester.data.loader import build_loader
    from maester.data.tokenizers import build_tokenizer
    from maester.tools.data_tokenize import tokenize

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir, docs = build_corpus(tmp / "text", args.mb)
        tok_cfg = TokenizerConfig(kind="hf", path=str(train_bpe(docs, tmp / "tokenizer.json", args.vocab)),
                                  bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
        tokenizer = build_tokenizer(tok_cfg)
        rows = []

        def naive():  # what a first script does: read the column, encode and write one document at a time
            import pyarrow.parquet as pq

            texts = pq.read_table(data_dir / "corpus.parquet", columns=["text"]).column(0).to_pylist()
            with IndexedDatasetWriter(tmp / "naive", np.uint16) as w:
                for text in texts:
                    w.add_document(tokenizer.encode(text) + [tokenizer.eos_id])

        naive_s, _ = timed(naive)
        n_tokens = IndexedDataset(tmp / "naive").num_tokens
        rows.append(("naive loop: encode and write one document at a time (baseline)", n_tokens / naive_s, "1.00"))
        prefix = tmp / "corpus"
        for workers in (1, 2):
            tok_s, _ = timed(lambda: tokenize([str(data_dir / "corpus.parquet")], str(prefix), tok_cfg,
                                              workers=workers, append_eod=True))
            written = IndexedDataset(f"{prefix}_text_document")
            assert np.array_equal(written.tokens(), IndexedDataset(tmp / "naive").tokens()), "outputs differ"
            rows.append((f"`maester data tokenize --workers {workers}`", n_tokens / tok_s, f"{naive_s / tok_s:.2f}"))

        def loader_rate(data: DataConfig, steps: int) -> float:
            start = time.perf_counter()  # from construction: reading metadata and the first chunks count too
            ld = build_loader(data, tok_cfg, tokenizer, seed=0, batch=BatchPlan(16, 16))
            for _ in range(steps):
                ld.next_step()
            return steps * 16 * args.seq_len / (time.perf_counter() - start)

        steps = 2 * n_tokens // (16 * args.seq_len)  # two epochs' worth
        text = DataConfig(sources=[DataSourceConfig(path=str(data_dir))], seq_len=args.seq_len, num_workers=0,
                          chunk_documents=256)
        rows.append(("text loader (Parquet, tokenize on the fly), in process", loader_rate(text, steps), ""))
        indexed = DataConfig(sources=[DataSourceConfig(path=f"{prefix}_text_document")], seq_len=args.seq_len)
        rows.append(("indexed loader (.bin/.idx)", loader_rate(indexed, steps), ""))

    print(f"\ncorpus: {args.mb:g} MB, {len(docs):,} documents, {n_tokens:,} tokens; BPE vocab {args.vocab}; "
          f"seq_len {args.seq_len}; {os.cpu_count()} CPU(s), python {sys.version.split()[0]}\n")
    print("| pipeline | tokens/s (one process) | speed-up |")
    print("|---|---|---|")
    for name, rate, ratio in rows:
        print(f"| {name} | {rate:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
