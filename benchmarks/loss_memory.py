"""Peak host memory of the LM loss (forward and backward) with the whole logits tensor vs in chunks of tokens.

    uv run python benchmarks/loss_memory.py [--tokens 4096] [--vocab 131072] [--dim 64] [--chunk 256]

Both variants run in one process, chunked first: each figure is the rise of the process's peak resident memory
(ru_maxrss, a high-water mark) over the inputs' baseline, so the two are measured by the same allocator in the
same process and their ratio does not depend on the machine. Also reported: the full variant's rise over the size
of one float32 logits tensor. Prints one table with the ratio chunked / full.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
import torch.nn.functional as F
from maester.models.loss import cross_entropy_sum, linear_cross_entropy_sum
tokens, vocab, dim, chunk = (int(a) for a in sys.argv[1:])
torch.manual_seed(0)
torch.set_num_threads(1)
h = torch.randn(tokens, dim, requires_grad=True)
w = (torch.randn(vocab, dim) * 0.02).requires_grad_()
labels = torch.randint(0, vocab, (tokens,))
# One-time costs (lazy kernel and thread-pool set-up) are paid on a few tokens before the baseline.
for small in (cross_entropy_sum(F.linear(h[:8], w), labels[:8]),
              linear_cross_entropy_sum(h[:8], w, labels[:8], chunk_tokens=4)):
    small.backward()
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for variant in ("chunked", "full"):  # the smaller peak first: ru_maxrss only rises
    h.grad = w.grad = None
    if variant == "full":
        loss = cross_entropy_sum(F.linear(h, w), labels)
    else:
        loss = linear_cross_entropy_sum(h, w, labels, chunk_tokens=chunk)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out[variant] = {"peak_mib": (peak - baseline) / 1024, "loss": loss.item(),
                    "grad_h": h.grad.abs().sum().item(), "grad_w": w.grad.abs().sum().item()}
    del loss
print(json.dumps(out))
"""


def measure(tokens: int, vocab: int, dim: int, chunk: int) -> dict:
    # A fixed mmap threshold makes glibc map every block over 64 KiB on its own and unmap it when freed, so the
    # resident peak follows the live tensors. With the default (dynamic) threshold, freed blocks of a few MiB are
    # kept in the heap and reused unevenly: the chunked loss's rise then grew with its number of chunks.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens), str(vocab), str(dim), str(chunk)],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=256)
    a = p.parse_args(argv)
    both = measure(a.tokens, a.vocab, a.dim, a.chunk)
    full, chunked = both["full"], both["chunked"]
    ratio = chunked["peak_mib"] / full["peak_mib"]
    logits_mib = a.tokens * a.vocab * 4 / 2**20
    print(f"\n{a.tokens} tokens x {a.vocab} vocabulary (dim {a.dim}), chunks of {a.chunk} tokens\n")
    print("| loss | peak memory rise | loss value |\n|---|---|---|")
    print(f"| full logits | {full['peak_mib']:.0f} MiB | {full['loss']:.6g} |")
    print(f"| chunked | {chunked['peak_mib']:.0f} MiB | {chunked['loss']:.6g} |")
    print(f"\nchunked / full peak: {ratio:.3f}; full peak / one float32 logits tensor "
          f"({logits_mib:.0f} MiB): {full['peak_mib'] / logits_mib:.2f}")
    return {"full": full, "chunked": chunked, "ratio": ratio, "full_over_logits": full["peak_mib"] / logits_mib}


if __name__ == "__main__":
    main()
