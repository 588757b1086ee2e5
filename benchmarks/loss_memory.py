"""Peak host memory of the LM loss (forward and backward) with the whole logits tensor vs in chunks of tokens.

    uv run python benchmarks/loss_memory.py [--tokens 4096] [--vocab 131072] [--dim 64] [--chunk 256]

Each variant runs in its own process: the figure is the rise of the process's peak resident memory
(ru_maxrss) over the loss, after the inputs exist. Prints one table with the ratio chunked / full.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
import torch.nn.functional as F
from maester.models.loss import cross_entropy_sum, linear_cross_entropy_sum
tokens, vocab, dim, chunk, variant = (int(a) if a.isdigit() else a for a in sys.argv[1:])
torch.manual_seed(0)
torch.set_num_threads(1)
h = torch.randn(tokens, dim, requires_grad=True)
w = (torch.randn(vocab, dim) * 0.02).requires_grad_()
labels = torch.randint(0, vocab, (tokens,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if variant == "full":
    loss = cross_entropy_sum(F.linear(h, w), labels)
else:
    loss = linear_cross_entropy_sum(h, w, labels, chunk_tokens=chunk)
loss.backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mib": (after - before) / 1024, "loss": loss.item(),
                  "grad_h": h.grad.abs().sum().item(), "grad_w": w.grad.abs().sum().item()}))
"""


def measure(tokens: int, vocab: int, dim: int, chunk: int, variant: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens), str(vocab), str(dim), str(chunk), variant],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=256)
    a = p.parse_args(argv)
    full = measure(a.tokens, a.vocab, a.dim, a.chunk, "full")
    chunked = measure(a.tokens, a.vocab, a.dim, a.chunk, "chunked")
    ratio = chunked["peak_mib"] / full["peak_mib"]
    print(f"\n{a.tokens} tokens x {a.vocab} vocabulary (dim {a.dim}), chunks of {a.chunk} tokens\n")
    print("| loss | peak memory rise | loss value |\n|---|---|---|")
    print(f"| full logits | {full['peak_mib']:.0f} MiB | {full['loss']:.6g} |")
    print(f"| chunked | {chunked['peak_mib']:.0f} MiB | {chunked['loss']:.6g} |")
    print(f"\nchunked / full peak: {ratio:.3f}")
    return {"full": full, "chunked": chunked, "ratio": ratio}


if __name__ == "__main__":
    main()
