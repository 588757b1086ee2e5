"""Sample text from a trained checkpoint or a Hugging Face model directory: greedy, temperature, top-k, top-p; one
prompt, or a file of them (a smoke suite)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from maester.config import Config
from maester.data.tokenizers import Tokenizer, build_tokenizer
from maester.models.build import build_model
from maester.train.checkpoint import resolve_checkpoint
from maester.train.checkpoint_files import load_model_weights


def load_for_inference(target: str | Path, device: torch.device) -> tuple[nn.Module, Tokenizer, Config]:
    """Model and tokenizer from a job directory or checkpoint (with the config saved in the checkpoint), or from an
    HF model directory (config.json, safetensors and the tokenizer.json beside them)."""
    from maester.tools.hf_dir import is_hf_model_dir

    if is_hf_model_dir(target):
        return load_hf_model_dir(Path(target), device)
    path = resolve_checkpoint(target)
    cfg = Config.from_json_file(path / "config.json")
    tokenizer = build_tokenizer(cfg.tokenizer)
    return load_checkpoint_model(path, cfg, tokenizer, device).eval(), tokenizer, cfg


def load_checkpoint_model(path: Path, cfg: Config, tokenizer: Tokenizer, device: torch.device) -> nn.Module:
    """The model of checkpoint `path`, built from its config `cfg`, in float32 on `device`."""
    model = build_model(cfg.model, tokenizer.vocab_size, device, 0, cfg.mup)
    load_model_weights(path, model)
    return model


def load_hf_model_dir(path: Path, device: torch.device) -> tuple[nn.Module, Tokenizer, Config]:
    """An HF model directory as a model (float32 on `device`), its tokenizer, and the config that describes them:
    the architecture from config.json (`model.hf_config`), the tokenizer and its chat template as `maester convert
    from-hf` would set them."""
    from maester.models.hf import read_hf_config, transformer_args_from_hf
    from maester.tools.hf_dir import hf_tokenizer_settings
    from maester.train.hf_weights import load_hf_weights

    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json: generating from an HF directory needs the model's "
                                f"tokenizer.json (and tokenizer_config.json) beside its weights")
    hf = read_hf_config(path)
    transformer_args_from_hf(hf, str(path / "config.json"))  # its errors name the file, not pydantic's Config
    cfg = Config.model_validate({"model": {"hf_config": str(path)}, **hf_tokenizer_settings(path, hf)})
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, tokenizer.vocab_size, device, 0, cfg.mup)
    load_hf_weights(path, model, cfg.model.name, str(path))
    return model.eval(), tokenizer, cfg


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    """One prompt: a text to continue, or a conversation (`messages`) to answer; `where` is its FILE:LINE."""

    where: str
    text: str | None = None
    messages: list[dict] | None = None


def read_prompts(path: str | Path) -> list[Prompt]:
    """A smoke suite: a text file with one prompt per line, or (`.jsonl`) one JSON object per line holding either
    `{"prompt": "..."}` or `{"messages": [{"role": ..., "content": ...}, ...]}`. A bad line is an error naming
    FILE:LINE."""
    from maester.data.records import InvalidRecord, messages_of

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} is a directory, not a file" if path.is_dir() else
                                f"prompts file {path} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path}: not UTF-8 text: {e}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        where = f"{path}:{n}"
        if not line.strip():
            raise ValueError(f"{where}: empty line (every line is a prompt)")
        if path.suffix != ".jsonl":
            prompts.append(Prompt(where, text=line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e}") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise ValueError(f"{where}: expected an object with either \"prompt\" or \"messages\", got "
                             f"{line[:80]}")
        if "prompt" in record:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise ValueError(f"{where}: \"prompt\" must be a non-empty string, got {record['prompt']!r}")
            prompts.append(Prompt(where, text=record["prompt"]))
        else:
            try:
                prompts.append(Prompt(where, messages=messages_of(record, where, "messages")))
            except InvalidRecord as e:
                raise ValueError(str(e)) from None
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompt")
    return prompts


class Completer:
    """Completes prompts with one model and one set of sampling settings. A text is continued (with BOS first when
    the config's `data.add_bos` says so), or with `chat` sent as a user message; a conversation is always answered
    in the chat template (the config's `data.sft`), up to its end of turn."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, cfg: Config, *, chat: bool = False,
                 max_new_tokens: int = 200, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0):
        self.model, self.tokenizer, self.cfg, self.chat = model, tokenizer, cfg, chat
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        self.max_new_tokens = max_new_tokens
        self._encoder = None

    def complete(self, prompt: Prompt) -> str:
        """The generated text: the answer of a chat prompt, the continuation of a text."""
        stop: set[int] = set()
        if prompt.messages is not None or self.chat:
            encoder, stop = self._chat()
            ids, _ = encoder.prompt(prompt.messages or [{"role": "user", "content": prompt.text}])
        else:
            ids = ([self.tokenizer.bos_id] if self.cfg.data.add_bos else []) + self.tokenizer.encode(prompt.text)
        out = sample(self.model, ids, self.max_new_tokens, eos_id=self.tokenizer.eos_id, stop_ids=stop,
                     **self.sampling)
        return self.tokenizer.decode(out)

    def _chat(self):
        """The chat encoder of the config's `data.sft` and the ids that end an answer, built once."""
        if self._encoder is None:
            from maester.data.chat import ChatEncoder

            encoder = ChatEncoder(self.tokenizer, self.cfg.data.sft, self.cfg.tokenizer.path)
            self._encoder = encoder, encoder.stop_ids()
        return self._encoder


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
