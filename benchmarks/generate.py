"""Decoding with a KV cache against re-running the whole sequence for each new token (the earlier sampler).

    uv run python benchmarks/generate.py            # demo Llama and tiny-width Gemma 3, 64-token prompt, 512 new
    uv run python benchmarks/generate.py --smoke    # 32 new tokens, to check the harness

Both ways run greedily from the same randomly initialised model in one process and must produce the same
tokens; the table gives new tokens per second (CPU seconds of this process, steadier on a shared machine than
wall time) and the speedup of the cache.
"""

from __future__ import annotations

import argparse
import time

import torch

from maester.config import ModelConfig
from maester.models.build import build_model
from maester.tools.generate import sample


@torch.no_grad()
def sample_without_cache(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The baseline: a full forward over every token so far for each new one."""
    ids = torch.tensor([prompt])
    for _ in range(max_new_tokens):
        next_id = int(model(ids)[0, -1].argmax())
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return ids[0, len(prompt):].tolist()


def timed(fn) -> tuple[list[int], float]:
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=512)
    args = parser.parse_args()
    new = 32 if args.smoke else args.new_tokens
    torch.set_num_threads(1)
    models = {"llama demo": ModelConfig(flavor="demo"),
              "gemma3 (demo width)": ModelConfig(name="gemma3", flavor="tiny", overrides=dict(
                  dim=192, n_heads=6, n_kv_heads=2, head_dim=32, query_pre_attn_scalar=32, ffn_hidden_dim=512,
                  sliding_window=128, max_seq_len=2048))}
    print("| model | new tokens | no cache (tok/s) | KV cache (tok/s) | speedup |")
    print("|---|---:|---:|---:|---:|")
    for label, cfg in models.items():
        model = build_model(cfg, 269, torch.device("cpu"), 0).eval()
        prompt = torch.randint(0, 269, (64,), generator=torch.Generator().manual_seed(0)).tolist()
        baseline, t_base = timed(lambda: sample_without_cache(model, prompt, new))
        cached, t_cache = timed(lambda: sample(model, prompt, new))
        if cached != baseline:
            raise SystemExit(f"{label}: the cached tokens differ from the baseline's")
        print(f"| {label} | {new} | {new / t_base:,.0f} | {new / t_cache:,.0f} | {t_base / t_cache:.1f}x |")


if __name__ == "__main__":
    main()
