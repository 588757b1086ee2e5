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
           top_k: int | None = None, eos_id: int | None = None, seed: int = 0,
           stop_ids: set[int] = frozenset()) -> list[int]:
    """Continue `prompt`; temperature 0 is greedy. Stops after `max_new_tokens`, at EOS or at any of `stop_ids`
    (a chat template's end of turn)."""
    stop = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], device=device)
    out: list[int] = []
    context = model.args.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(ids[:, -context:])[0, -1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if next_id in stop:
            break
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    return out
