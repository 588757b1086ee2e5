"""Decoding with a KV cache: greedy, temperature, top-k, top-p; one prompt, or a batch of prompts left-padded to
one length and decoded together with the same tokens as one at a time."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None, seed: int = 0,
           stop_ids: set[int] = frozenset(), on_token: Callable[[int], None] | None = None,
           vocab_size: int | None = None) -> list[int]:
    """Continue `prompt` with a KV cache: one forward over the prompt, then one per new token. Temperature 0
    is greedy; otherwise sample from the temperature-scaled distribution cut to the `top_k` most likely
    tokens and to the smallest set holding `top_p` of the probability. Stops after `max_new_tokens`, at the
    model's context length, at EOS or at any of `stop_ids` (a chat template's end of turn). `on_token` is called
    with each new token as it is chosen (streaming). Only ids below `vocab_size` (the tokenizer's vocabulary; the
    embedding may have padding rows beyond it) are ever chosen."""
    stream = None if on_token is None else (lambda row, token: on_token(token))
    return sample_batch(model, [prompt], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_id=eos_id, seed=seed, stop_ids=stop_ids, on_token=stream, vocab_size=vocab_size)[0]


@torch.no_grad()
def sample_batch(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None, seed: int = 0,
                 stop_ids: set[int] = frozenset(), on_token: Callable[[int, int], None] | None = None,
                 stop_when: Callable[[int, list[int]], bool] | None = None, device: torch.device | None = None,
                 cache_dtype: torch.dtype | None = None, most: Callable[[int], int] | None = None,
                 seq_multiple: int = 1, vocab_size: int | None = None) -> list[list[int]]:
    """`sample` for each of `prompts` at once: they are left-padded to the longest (the padding masked out, each
    row's positions counted from its first token), each row stops on its own, and each samples from its own
    generator seeded with `seed`, so a prompt gets the tokens it gets alone. `on_token(row, token)`: streaming.

    For a model as training shards it: `stop_when(row, tokens)`, the row also ends after a token that makes it true
    (a stop string in its text). `device` and `cache_dtype`: where the inputs go and what the KV cache holds
    (default: the weights'; weights offloaded to the CPU, or mixed precision, say otherwise). `most(n)`: the
    largest `n` of the processes that must run their forwards in step (sharded weights are gathered in every
    forward): each then runs as many as the longest of them needs. `seq_multiple`: every forward takes a multiple
    of this many positions (sequence parallel splits them over the ranks): the prompts are left-padded further,
    and each new token is followed by filler positions that the next step overwrites."""
    context = model.args.max_seq_len
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, context)
    for prompt in prompts:
        if not prompt:
            raise ValueError("generation needs a prompt of at least one token")
        if len(prompt) >= context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {context}")
    stop = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    weight = next(model.parameters())
    device = device or weight.device
    limits = [min(max_new_tokens, context - len(p)) for p in prompts]
    longest, steps = -(-max(map(len, prompts)) // seq_multiple) * seq_multiple, max(limits)
    if most is not None:
        steps = most(steps)
    cache = _new_cache(model, len(prompts), longest + steps + seq_multiple - 1, device, cache_dtype or weight.dtype)
    logits, positions = _prefill(model, prompts, longest, cache, device)
    generators = [torch.Generator(device=device).manual_seed(seed) for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    done = [limit <= 0 for limit in limits]
    for _ in range(steps):
        picked = [0] * len(prompts)  # a finished row is fed token 0, and its logits ignored
        for row in range(len(prompts)):
            if done[row]:
                continue
            token = _pick(logits[row, :vocab_size].float(), temperature, top_k, top_p, generators[row])
            if token in stop:
                done[row] = True
                continue
            picked[row] = token
            out[row].append(token)
            if on_token is not None:
                on_token(row, token)
            done[row] = len(out[row]) >= limits[row] or (stop_when is not None and stop_when(row, out[row]))
        if all(done) if most is None else most(0 if all(done) else 1) == 0:
            break
        logits = _decode(model, picked, positions, cache, device, seq_multiple)
        if positions is not None:
            positions = positions + 1
    return out


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None, seed: int,
                   context: int | None = None) -> None:
    """Refuse sampling settings that mean nothing (named as the `generate` and `chat` options name them), and more
    new tokens than the model's `context` can ever hold."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be 0 or more, got {max_new_tokens}")
    if context is not None and max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: the model's context is {context} tokens, prompt "
                         f"included, so at most {context - 1} new tokens can follow a prompt")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature must be a finite number, 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be at least 1, got {top_k}")
    if top_p is not None and not (0 < top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if seed < 0:
        raise ValueError(f"--seed must be 0 or more, got {seed}")


def _prefill(model: nn.Module, prompts: list[list[int]], length: int, cache, device: torch.device):
    """One forward over the prompts left-padded to `length`: the logits of their last position, and (with padding)
    the position of each row's next token."""
    pads = torch.tensor([length - len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts], device=device)
    if not pads.any():
        return _last_logits(model(ids, cache=cache)), None
    real = (torch.arange(length, device=device)[None] >= pads[:, None]).long()
    positions = (real.cumsum(1) - 1).clamp(min=0)
    logits = _last_logits(model(ids, position_ids=positions, cache=cache, attention_mask=real))
    return logits, positions[:, -1:] + 1


def _decode(model: nn.Module, picked: list[int], positions: torch.Tensor | None, cache, device: torch.device,
            seq_multiple: int) -> torch.Tensor:
    """The logits after feeding each row its picked token (and `seq_multiple - 1` filler positions after it, whose
    cache entries the next step overwrites: no query attends to them before that)."""
    ids = torch.tensor(picked, device=device)[:, None]
    if seq_multiple == 1:
        return _last_logits(model(ids, position_ids=positions, cache=cache))
    fill = seq_multiple - 1
    ids = torch.cat([ids, ids.new_zeros(len(picked), fill)], dim=1)
    if positions is not None:
        positions = positions + torch.arange(seq_multiple, device=device)[None]
    logits = model(ids, position_ids=positions, cache=cache)
    cache.length -= fill
    return _last_logits(logits[:, :1])


def _new_cache(model: nn.Module, batch: int, length: int, device: torch.device, dtype: torch.dtype):
    """A KV cache for `model`, with the key/value heads this process holds (all, or its share under TP; FSDP
    gathers its shards of them in the forward)."""
    from torch.distributed.tensor import DTensor

    from maester.models.transformer import KVCache

    k_proj = next(iter(model.layers.values())).attention.k_proj.weight
    tp = 1
    if isinstance(k_proj, DTensor) and "tp" in (k_proj.device_mesh.mesh_dim_names or ()):
        tp = k_proj.device_mesh.size(k_proj.device_mesh.mesh_dim_names.index("tp"))
    return KVCache(model.args, batch, length, device, dtype, kv_heads=model.args.n_kv_heads // tp)


def _last_logits(logits: torch.Tensor) -> torch.Tensor:
    """(batch, vocab) at the last position; of a vocabulary-sharded DTensor (tensor parallel), that position alone
    is gathered, so every process picks from the same numbers."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        logits = logits[:, -1:].full_tensor()
    return logits[:, -1]


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
          generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already hold top_p (the most likely one always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
