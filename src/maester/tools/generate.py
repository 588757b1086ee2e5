"""Sample text from a trained checkpoint: greedy, temperature and top-k."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from maester.config import Config
from maester.data.tokenizers import Tokenizer, build_tokenizer
from maester.models.build import build_on_meta, materialize, resolve_args
from maester.train.checkpoint import load_model_weights, resolve_checkpoint


def load_for_inference(target: str | Path, device: torch.device) -> tuple[nn.Module, Tokenizer, Config]:
    """Model and tokenizer from a job directory or checkpoint, using the config saved in the checkpoint."""
    path = resolve_checkpoint(target)
    cfg = Config.from_json_file(path / "config.json")
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = materialize(build_on_meta(cfg.model, resolve_args(cfg.model, tokenizer.vocab_size)), device, 0)
    load_model_weights(path, model)
    return model.eval(), tokenizer, cfg


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None, seed: int = 0,
           stop_ids: set[int] = frozenset()) -> list[int]:
    """Continue `prompt` with a KV cache: one forward over the prompt, then one per new token. Temperature 0
    is greedy; otherwise sample from the temperature-scaled distribution cut to the `top_k` most likely
    tokens and to the smallest set holding `top_p` of the probability. Stops after `max_new_tokens`, at the
    model's context length, at EOS or at any of `stop_ids` (a chat template's end of turn)."""
    from maester.models.transformer import KVCache

    if not prompt:
        raise ValueError("generation needs a prompt of at least one token")
    context = model.args.max_seq_len
    if len(prompt) >= context:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {context}")
    stop = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    weight = next(model.parameters())
    device = weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    steps = min(max_new_tokens, context - len(prompt))
    cache = KVCache(model.args, 1, len(prompt) + steps, device, weight.dtype)
    logits = model(torch.tensor([prompt], device=device), cache=cache)[0, -1]
    out: list[int] = []
    for step in range(steps):
        next_id = _pick(logits.float(), temperature, top_k, top_p, generator)
        if next_id in stop:
            break
        out.append(next_id)
        if step + 1 < steps:
            logits = model(torch.tensor([[next_id]], device=device), cache=cache)[0, -1]
    return out


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
