"""Where a forward + backward spends its time on the CPU: torch.profiler's self time by op, our Llama against
`transformers`' `LlamaForCausalLM` on the same weights (8 x 512 tokens, 6 layers x 384, eager, float32).

    uv run python -m benchmarks.hot_path               # one thread: CPU time, steady under other load
    uv run python -m benchmarks.hot_path --threads 2

(`-m` from the repository root: it takes the shapes and the peer from `benchmarks/peers.py`.)

Ops are grouped: matmul (aten::mm/addmm/bmm), attention (SDPA's kernels, forward and backward), and the rest
(norms, RoPE, activations, residual adds, copies), the part a model's code decides.

Then the bound: the matmuls' rate in the model (the profiler's FLOP count over their time) against this machine's
GEMM rate on a 2048 x 2048 x 2048 product alone, and the fastest our forward + backward could be if "the rest" took
no time at all, as a ratio to transformers' measured time.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

GROUPS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm")), ("attention", ("scaled_dot_product",)))


def group_of(op: str) -> str:
    for name, keys in GROUPS:
        if any(k in op for k in keys):
            return name
    return "the rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12, help="ops of 'the rest' listed")
    parser.add_argument("--quick", action="store_true", help="the tiny shapes of peers.py --quick (a smoke test)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.peers import FULL, QUICK, hf_llama, our_args
    from maester.models.hf_tensors import state_dict_to_hf
    from maester.models.transformer import Transformer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = QUICK if args.quick else FULL
    margs = our_args(shape)
    ours = Transformer(margs)
    ours.init_weights()
    peer = hf_llama(margs)
    peer.load_state_dict(state_dict_to_hf("llama", margs, ours.state_dict()), strict=False)
    batch, seq = shape["fb_tokens"]
    ids = torch.randint(0, margs.vocab_size, (batch, seq))
    labels = torch.randint(0, margs.vocab_size, (batch, seq))

    def run_ours():
        (ours(ids, labels=labels) / labels.numel()).backward()
        ours.zero_grad(set_to_none=True)

    def run_peer():
        F.cross_entropy(peer(input_ids=ids).logits.flatten(0, 1).float(), labels.flatten()).backward()
        peer.zero_grad(set_to_none=True)

    by_op: dict[str, dict[str, float]] = {}
    for _ in range(2):  # warm-up of both: the allocator settles (a first touch of new pages costs page faults)
        run_ours()
        run_peer()
    for name, run in (("transformers", run_peer), ("maester", run_ours)):
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            run()
        events = prof.key_averages()
        by_op[name] = {e.key: e.self_cpu_time_total / 1e3 for e in events}
        if name == "maester":
            matmul_flops = sum(e.flops for e in events if group_of(e.key) == "matmul")
    totals = {name: defaultdict(float) for name in by_op}
    for name, ops in by_op.items():
        for op, ms in ops.items():
            totals[name][group_of(op)] += ms
    print(f"forward + backward, {batch} x {seq} tokens, {margs.n_layers} x {margs.dim}, {args.threads} thread(s), torch {torch.__version__}")
    print("| ops | maester ms | transformers ms |")
    print("|---|---|---|")
    for group in ("matmul", "attention", "the rest"):
        print(f"| {group} | {totals['maester'][group]:.1f} | {totals['transformers'][group]:.1f} |")
    print(f"| **total** | {sum(totals['maester'].values()):.1f} | {sum(totals['transformers'].values()):.1f} |")
    rest = sorted({op for ops in by_op.values() for op in ops if group_of(op) == "the rest"},
                  key=lambda op: -max(by_op["maester"].get(op, 0), by_op["transformers"].get(op, 0)))
    print()
    print("| op (the rest) | maester ms | transformers ms |")
    print("|---|---|---|")
    for op in rest[:args.top]:
        print(f"| `{op}` | {by_op['maester'].get(op, 0):.1f} | {by_op['transformers'].get(op, 0):.1f} |")
    in_model = matmul_flops / totals["maester"]["matmul"] / 1e6
    n = 512 if args.quick else 2048
    alone = gemm_rate(torch, n)
    floor = matmul_flops / alone / 1e6 + totals["maester"]["attention"]
    print()
    print(f"matmul in our model: {matmul_flops / 1e9:.0f} GFLOP at {in_model:.0f} GFLOP/s; a {n}^3 GEMM alone: "
          f"{alone:.0f} GFLOP/s ({in_model / alone:.0%})")
    print(f"our time with every matmul at that rate and the rest at zero: {floor:.0f} ms = "
          f"{floor / sum(totals['transformers'].values()):.2f}x transformers' measured time")


def gemm_rate(torch, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one n x n x n float32 product, best of `repeats`, in CPU time of this thread."""
    import time

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - start)
    return 2 * n ** 3 / best / 1e9


if __name__ == "__main__":
    main()
