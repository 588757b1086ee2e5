"""Packing of conversations into rows: best-fit decreasing against next-fit, on lognormal lengths.

    uv run python benchmarks/packing.py            # 100k and 1M conversations, rows of 4096 tokens
    uv run python benchmarks/packing.py --smoke    # 10k conversations, to check the harness

Conversation lengths are drawn from a lognormal with median 300 tokens and sigma 1 (mean about 490), clipped to
[1, seq_len]: right-skewed like chat SFT sets, with most conversations a few hundred tokens and a long tail of
thousands. Each row of the table packs the same lengths, in one process, timed from the lengths array to the
bins (index arrays), without laying out tokens:

  best-fit decreasing  `maester.data.packing.best_fit_decreasing` (longest first, into the fullest bin that
                       fits)
  next-fit (baseline)  lengths in a seeded random order, each into the current bin or, when it does not fit, a
                       new one: what torchtune's PackedDataset and GPT-NeoX's pack_until_overflow do

Efficiency is tokens / (rows x seq_len); the volume bound is ceil(tokens / seq_len) rows. Seconds are wall
time, CPU seconds the process's own (steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def lognormal_lengths(n: int, seq_len: int, seed: int, median: float = 300.0, sigma: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 1, seq_len).astype(np.int64)


def next_fit(lengths: np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """The baseline: items in a seeded random order, a new bin whenever the next one does not fit."""
    bins: list[list[int]] = []
    current: list[int] = []
    used = 0
    order = np.random.default_rng(seed).permutation(len(lengths))
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        if used + n > capacity:
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        bins.append(current)
    return bins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="10k conversations, to check the harness")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from maester.data.packing import best_fit_decreasing, packing_efficiency

    sizes = [10_000] if args.smoke else [100_000, 1_000_000]
    print("| conversations | algorithm | rows | volume bound | efficiency | seconds | CPU seconds |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        lengths = lognormal_lengths(n, args.seq_len, args.seed)
        total = int(lengths.sum())
        bound = -(-total // args.seq_len)
        for name, pack in (("best-fit decreasing", best_fit_decreasing), ("next-fit (baseline)", next_fit)):
            start, cpu = time.perf_counter(), time.process_time()
            bins = pack(lengths, args.seq_len, args.seed)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            placed = np.sort(np.concatenate([np.asarray(b, dtype=np.int64) for b in bins]))
            if not np.array_equal(placed, np.arange(n)) or max(int(lengths[b].sum()) for b in bins) > args.seq_len:
                raise SystemExit(f"{name}: lost, repeated or overfull items")
            efficiency = packing_efficiency(total, len(bins), args.seq_len)
            print(f"| {n:,} | {name} | {len(bins):,} | {bound:,} | {efficiency:.3%} | {seconds:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
