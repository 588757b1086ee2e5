"""maester against its peers on this machine, same shapes and parameter counts, one command:

    uv run python benchmarks/peers.py            # the table of benchmarks/README.md (about 10 minutes on 2 cores)
    uv run python benchmarks/peers.py --quick    # tiny shapes, a few steps: checks the harness (run by the tests)

Rows:
- forward + backward of our Llama against `transformers`' `LlamaForCausalLM` on the same weights (8 x 512 tokens,
  6 layers x 384), both eager, alternated in one process; the losses must agree.
- training tokens/s: `maester train` (the demo config at 6 x 384, seq 256, batch 16, tied embeddings) against a
  plain PyTorch loop (AdamW with torch's defaults, clipping at 1.0, same batch and LR) around `transformers`'
  `LlamaForCausalLM` (the same architecture) and `GPT2LMHeadModel` (nanoGPT's architecture, the same parameter
  count within 1%), each in its own process; then both compiled (`parallel.compile` against
  `torch.compile(model)`). Median tokens/s over the steps after the warm-up (compilation included there).

Peers come from installed packages; the plain loops feed random tokens (no data loading, which favours them).
Ratios above 1 mean maester is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FULL = dict(dim=384, n_layers=6, n_heads=6, ffn=1024, seq=256, batch=16, steps=30, warmup=5, fb_tokens=(8, 512),
            fb_rounds=7)
QUICK = dict(dim=64, n_layers=2, n_heads=4, ffn=192, seq=64, batch=4, steps=4, warmup=1, fb_tokens=(2, 64),
             fb_rounds=2)
LR = 3e-3


def overrides(shape: dict) -> dict:
    return {"dim": shape["dim"], "n_layers": shape["n_layers"], "n_heads": shape["n_heads"],
            "n_kv_heads": shape["n_heads"], "ffn_hidden_dim": shape["ffn"], "tie_embeddings": True}


def our_args(shape: dict):
    """Our Llama's TransformerArgs at `shape`, vocabulary as the demo's byte tokenizer makes it."""
    from maester.config import ModelConfig
    from maester.data.tokenizers import ByteTokenizer
    from maester.models.build import resolve_args

    cfg = ModelConfig(name="llama", flavor="demo", overrides=overrides(shape), attention="sdpa")
    return resolve_args(cfg, ByteTokenizer().vocab_size)


def hf_llama(args):
    import torch
    import transformers

    from maester.models.hf import hf_config

    config = transformers.AutoConfig.for_model(**hf_config("llama", args))
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def hf_gpt2(args, seq: int):
    """GPT-2 (nanoGPT's model) with our width, depth, heads and vocabulary: 2 x 4·dim MLP matrices hold what our
    3 x ffn SwiGLU matrices hold at ffn = 8/3·dim."""
    import transformers

    config = transformers.GPT2Config(vocab_size=args.vocab_size, n_positions=seq, n_embd=args.dim,
                                     n_layer=args.n_layers, n_head=args.n_heads, tie_word_embeddings=True,
                                     attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(config)


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ forward + backward on the same weights

def forward_backward(shape: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from maester.models.hf_tensors import state_dict_to_hf
    from maester.models.transformer import Transformer

    torch.manual_seed(0)
    args = our_args(shape)
    ours = Transformer(args)
    ours.init_weights()
    peer = hf_llama(args)
    missing, unexpected = peer.load_state_dict(state_dict_to_hf("llama", args, ours.state_dict()), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # the tied head is the embedding
        raise RuntimeError(f"weights did not map: missing {missing}, unexpected {unexpected}")
    batch, seq = shape["fb_tokens"]
    ids = torch.randint(0, args.vocab_size, (batch, seq))
    labels = torch.randint(0, args.vocab_size, (batch, seq))

    def run_ours():
        loss = ours(ids, labels=labels) / labels.numel()
        loss.backward()
        ours.zero_grad(set_to_none=True)
        return loss.item()

    def run_peer():
        logits = peer(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        peer.zero_grad(set_to_none=True)
        return loss.item()

    losses = (run_ours(), run_peer())  # also the warm-up
    times = {"ours": [], "peer": []}
    for _ in range(shape["fb_rounds"]):
        for name, run in (("ours", run_ours), ("peer", run_peer)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"ours_s": median["ours"], "peer_s": median["peer"], "loss_ours": losses[0], "loss_peer": losses[1],
            "parameters": parameters(ours)}


# ------------------------------------------------------------------ training loops

def plain_loop(kind: str, shape: dict, compile: bool) -> dict:
    """A user's own loop around a `transformers` model: AdamW, clipping, random tokens; one step per batch."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    args = our_args(shape)
    model = hf_llama(args) if kind == "llama" else hf_gpt2(args, shape["seq"])
    count = parameters(model)
    step_model = torch.compile(model) if compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    seconds = []
    for _ in range(shape["steps"]):
        ids = torch.randint(0, args.vocab_size, (shape["batch"], shape["seq"] + 1))
        start = time.perf_counter()
        logits = step_model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        seconds.append(time.perf_counter() - start)
    steady = seconds[shape["warmup"]:]
    return {"tokens_per_second": shape["batch"] * shape["seq"] / statistics.median(steady), "parameters": count,
            "first_step_s": seconds[0]}


def maester_train(shape: dict, compile: bool) -> dict:
    """`maester train` of the demo config at `shape`: the median of its own per-step tokens/s."""
    from maester.train.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_")}
        env.setdefault("XDG_CACHE_HOME", str(Path(tmp) / "cache"))
        command = [sys.executable, "-m", "maester", "train", str(REPO / "configs" / "demo.toml"),
                   f"--job.dump_dir={tmp}/jobs", f"--model.overrides={json.dumps(overrides(shape))}",
                   "--model.attention=sdpa", f"--data.seq_len={shape['seq']}", f"--training.steps={shape['steps']}",
                   f"--training.global_batch_size={shape['batch']}", f"--training.micro_batch_size={shape['batch']}",
                   f"--optimizer.lr={LR}", "--schedule.warmup_steps=1", "--logging.interval=1",
                   "--checkpoint.interval=0", "--checkpoint.save_final=false", f"--parallel.compile={str(compile).lower()}"]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        job = next((Path(tmp) / "jobs").iterdir())
        records = read_metrics(job / "metrics.jsonl")
    steady = records[shape["warmup"]:]
    return {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in steady),
            "parameters": our_parameters(shape), "first_step_s": records[0]["step_seconds"]}


def our_parameters(shape: dict) -> int:
    import torch

    from maester.models.transformer import Transformer

    with torch.device("meta"):
        return parameters(Transformer(our_args(shape)))


# ------------------------------------------------------------------ the table

def one(task: str, shape: dict) -> dict:
    if task == "forward-backward":
        return forward_backward(shape)
    kind, mode = task.split(":")
    compile = mode == "compiled"
    return maester_train(shape, compile) if kind == "maester" else plain_loop(kind, shape, compile)


def in_own_process(task: str, quick: bool) -> dict:
    """Each measurement in a fresh process: no allocator, thread pool or compile cache carried between them. With
    `quick` (a check of the harness, whose figures mean nothing) in this one: an interpreter importing torch and
    transformers costs more than the task."""
    if quick:
        return one(task, QUICK)
    out = subprocess.run([sys.executable, __file__, "--task", task, *(["--quick"] if quick else [])],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{task} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(quick: bool, compiled: bool) -> list[str]:
    import torch

    shape = QUICK if quick else FULL
    what = (f"{shape['n_layers']} layers x {shape['dim']}, seq {shape['seq']}, batch {shape['batch']}, "
            f"{shape['steps']} steps (median after {shape['warmup']}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")
    lines = [f"peers on {what}", "", "| comparison | maester | peer | ratio (>1: maester faster) |", "|---|---|---|---|"]
    fb = in_own_process("forward-backward", quick)
    rel = abs(fb["loss_ours"] - fb["loss_peer"]) / abs(fb["loss_peer"])
    if rel > 1e-5:
        raise RuntimeError(f"forward + backward: losses differ ({fb['loss_ours']} vs {fb['loss_peer']})")
    batch, seq = shape["fb_tokens"]
    lines.append(f"| forward + backward, {batch} x {seq} tokens, same weights (loss {fb['loss_ours']:.6f} both) | "
                 f"{fb['ours_s']:.3f} s | {fb['peer_s']:.3f} s (transformers Llama) | "
                 f"{fb['peer_s'] / fb['ours_s']:.2f}x (time {fb['ours_s'] / fb['peer_s']:.2f}x) |")
    modes = ["eager", "compiled"] if compiled else ["eager"]
    for mode in modes:
        ours = in_own_process(f"maester:{mode}", quick)
        for kind, name in (("llama", "transformers Llama"), ("gpt2", "transformers GPT-2")):
            peer = in_own_process(f"{kind}:{mode}", quick)
            lines.append(f"| training tokens/s, {mode}, plain loop around {name} ({peer['parameters'] / 1e6:.2f}M "
                         f"parameters; maester {ours['parameters'] / 1e6:.2f}M) | {ours['tokens_per_second']:,.0f} | {peer['tokens_per_second']:,.0f} | "
                         f"{ours['tokens_per_second'] / peer['tokens_per_second']:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few steps (checks the harness)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled rows")
    parser.add_argument("--task", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        print(json.dumps(one(args.task, QUICK if args.quick else FULL)))
        return
    print("\n".join(table(args.quick, compiled=not args.no_compile)))


if __name__ == "__main__":
    main()
