"""Sample text from a trained checkpoint or a Hugging Face model directory: greedy, temperature, top-k, top-p; one
prompt, or a file of them (a smoke suite)."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from maester.config import Config
from maester.data.tokenizers import Tokenizer, build_tokenizer
from maester.models.sampling import check_sampling, sample, sample_batch
from maester.train.checkpoint import resolve_checkpoint
from maester.train.checkpoint_dirs import step_dirs
from maester.train.checkpoint_files import read_trainer_state
from maester.train.checkpoint_pin import Pins
from maester.train.checkpoint_reader import load_model_weights

log = logging.getLogger("maester")

PIN_ATTEMPTS = 5
"""Choices of the newest checkpoint before a reader gives up: each lost race is to a save and its retention."""


def start_inference(device_choice: str, dtype_choice: str,
                    tensor_parallel: bool = True) -> tuple[torch.device, torch.dtype, object, int]:
    """This process's device (`--device`) and the dtype (`--dtype`, `auto`: bfloat16 on GPUs, float32 on CPU);
    under torchrun (WORLD_SIZE > 1), also the process group and, with `tensor_parallel`, a tensor-parallel mesh over
    every process (without: each process holds the whole model, data parallel). Returns (device, dtype, the mesh
    or None, rank)."""
    import torch.distributed as dist

    from maester.parallel.devices import choose_inference_device, process_group_backend
    from maester.parallel.precision import inference_dtype

    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and device_choice.startswith("cuda:"):
        raise ValueError(f"--device {device_choice} names one GPU, but torchrun started {world} processes, each of "
                         f"which takes the GPU of its LOCAL_RANK: pass --device cuda")
    device = choose_inference_device(device_choice, local_rank)
    dtype = inference_dtype(dtype_choice, device.type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return device, dtype, None, 0
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group(process_group_backend(device.type))
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",)) if tensor_parallel else None
    return device, dtype, mesh, dist.get_rank()


@dataclass
class Loaded:
    """A model read for inference, with where it was read from: a checkpoint (and its step) or an HF directory."""

    model: nn.Module
    tokenizer: Tokenizer
    cfg: Config
    source: Path
    step: int | None = None

    def describe(self) -> str:
        return f"{self.source} " + (f"(step {self.step})" if self.step is not None else "(a Hugging Face model)")


def load_for_inference(target: str | Path, device: torch.device, dtype: torch.dtype = torch.float32,
                       tp_mesh=None) -> tuple[nn.Module, Tokenizer, Config]:
    """`read_for_inference`'s model, tokenizer and config."""
    loaded = read_for_inference(target, device, dtype, tp_mesh)
    return loaded.model, loaded.tokenizer, loaded.cfg


def read_for_inference(target: str | Path, device: torch.device, dtype: torch.dtype = torch.float32,
                       tp_mesh=None) -> Loaded:
    """Model and tokenizer from a job directory or checkpoint (with the config saved in the checkpoint, which is
    pinned against the job's retention while it is read), or from an HF model directory (config.json, safetensors
    and the tokenizer.json beside them) or Hub id `org/name[@revision]`, fetched into the Hugging Face cache. The
    model is built on the meta device with its parameters in `dtype`, then allocated on `device` and filled from
    the weights: no float32 copy of it is made first. With `tp_mesh` it is sharded over that mesh before it is
    allocated (the training TP plan without sequence parallel), so each process holds its share of every block."""
    from maester.hub import is_hub_id, local_path
    from maester.tools.hf_dir import is_hf_model_dir
    from maester.train.hf_weights import load_hf_weights

    if is_hub_id(str(target)):
        target = local_path(str(target), "generate")
    if is_hf_model_dir(target):
        path = Path(target)
        cfg = hf_model_config(path)
        tokenizer = build_tokenizer(cfg.tokenizer)
        model = build_for_loading(cfg, tokenizer, device, dtype, tp_mesh)
        load_hf_weights(path, model, cfg.model.name, str(path))
        return Loaded(model.eval(), tokenizer, cfg, path)
    with pinned_checkpoint(target) as path:
        cfg = Config.from_json_file(path / "config.json")
        tokenizer = build_tokenizer(cfg.tokenizer)
        model = build_for_loading(cfg, tokenizer, device, dtype, tp_mesh)
        load_model_weights(path, model)
        return Loaded(model.eval(), tokenizer, cfg, path, read_trainer_state(path).get("step"))


@contextmanager
def pinned_checkpoint(target: str | Path, level: str = "size"):
    """`resolve_checkpoint(target, level)`, pinned against retention while inside: every `step-<N>` of the job is
    pinned first (a save meanwhile cannot remove the one about to be chosen), the choice is made among them, and
    the others are let go."""
    target = Path(target)
    candidates = [target] if (target / ".metadata").is_file() else step_dirs(target) + step_dirs(
        target / "checkpoints")
    for _ in range(PIN_ATTEMPTS):
        pins = Pins()
        try:
            for step in candidates:
                pins.add(step)
            path = resolve_checkpoint(target, level)
            if path in pins.held or pins.add(path):
                pins.keep_only(path)
                yield path
                return
        finally:
            pins.release()
        log.info("%s was removed while it was chosen; choosing the newest checkpoint again", path)
        candidates = step_dirs(target) + step_dirs(target / "checkpoints")
    raise ValueError(f"{target}: every checkpoint chosen was removed before it could be read ({PIN_ATTEMPTS} times): "
                     f"its job saves faster than its checkpoints can be opened; run again, or read a checkpoint "
                     f"that retention keeps (checkpoint.keep_every)")


def load_checkpoint_model(path: Path, cfg: Config, tokenizer: Tokenizer, device: torch.device,
                          dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of checkpoint `path`, built from its config `cfg`, in `dtype` on `device`."""
    model = build_for_loading(cfg, tokenizer, device, dtype)
    load_model_weights(path, model)
    return model


def build_for_loading(cfg: Config, tokenizer: Tokenizer, device: torch.device, dtype: torch.dtype,
                      tp_mesh=None) -> nn.Module:
    """The model of `cfg` on `device` with its parameters in `dtype`, uninitialised (weights are loaded next);
    sharded with tensor parallel over `tp_mesh` when given."""
    from maester.models.build import build_on_meta, materialize_for_loading, resolve_args

    args = resolve_args(cfg.model, tokenizer.vocab_size, cfg.mup)
    model = build_on_meta(cfg.model, args, dtype)
    if tp_mesh is not None:
        from maester.parallel.parallelize import apply_tensor_parallel

        tp = tp_mesh.size()
        for name in ("n_heads", "n_kv_heads", "ffn_hidden_dim"):
            if getattr(args, name) % tp:
                raise ValueError(f"tensor parallel over {tp} processes does not divide the model's {name} "
                                 f"({getattr(args, name)}): launch a number of processes that divides it")
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=False)
    return materialize_for_loading(model, device)


def hf_model_config(path: Path) -> Config:
    """The config that describes an HF model directory: the architecture from config.json (`model.hf_config`),
    the tokenizer and its chat template as `maester convert from-hf` would set them."""
    from maester.models.hf import read_hf_config, transformer_args_from_hf
    from maester.tools.hf_dir import hf_tokenizer_settings

    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json: generating from an HF directory needs the model's "
                                f"tokenizer.json (and tokenizer_config.json) beside its weights")
    hf = read_hf_config(path)
    transformer_args_from_hf(hf, str(path / "config.json"))  # its errors name the file, not pydantic's Config
    return Config.model_validate({"model": {"hf_config": str(path)}, **hf_tokenizer_settings(path, hf)})


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
        check_sampling(max_new_tokens, temperature, top_k, top_p, seed, model.args.max_seq_len)
        self.model, self.tokenizer, self.cfg, self.chat = model, tokenizer, cfg, chat
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             vocab_size=tokenizer.vocab_size)
        self.max_new_tokens = max_new_tokens
        self._encoder = None

    def complete(self, prompt: Prompt) -> str:
        """The generated text: the answer of a chat prompt, the continuation of a text."""
        return self.complete_batch([prompt])[0]

    def complete_batch(self, prompts: list[Prompt], batch_size: int = 1) -> list[str]:
        """`complete` of each prompt, decoded `batch_size` at a time in left-padded batches (the same tokens as one
        at a time); a batch holds prompts of one kind (chat or text), which stop at the same tokens."""
        if batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
        encoded = [self.encode(p) for p in prompts]
        results: list[str] = []
        start = 0
        while start < len(encoded):
            end = start + 1
            while end < len(encoded) and end - start < batch_size and encoded[end][1] == encoded[start][1]:
                end += 1
            outs = sample_batch(self.model, [ids for ids, _ in encoded[start:end]], self.max_new_tokens,
                                eos_id=self.tokenizer.eos_id, stop_ids=encoded[start][1], **self.sampling)
            results += [self.tokenizer.decode(out) for out in outs]
            start = end
        return results

    def stream(self, prompt: Prompt, write) -> str:
        """`complete` of one prompt, its text passed to `write` piece by piece as the tokens are chosen (a piece is
        held back while it ends inside a character that later tokens complete)."""
        ids, stop = self.encode(prompt)
        out: list[int] = []
        shown = ""

        def on_token(token: int) -> None:
            nonlocal shown
            out.append(token)
            text = self.tokenizer.decode(out)
            if not text.endswith("\ufffd") and text.startswith(shown):
                write(text[len(shown):])
                shown = text

        sample(self.model, ids, self.max_new_tokens, eos_id=self.tokenizer.eos_id, stop_ids=stop,
               on_token=on_token, **self.sampling)
        text = self.tokenizer.decode(out)
        if text.startswith(shown) and text != shown:
            write(text[len(shown):])
        return text

    def encode(self, prompt: Prompt) -> tuple[list[int], frozenset[int]]:
        """The prompt's token ids and the ids that end its answer (besides EOS)."""
        if prompt.messages is not None or self.chat:
            encoder, stop = self._chat()
            ids, _ = encoder.prompt(prompt.messages or [{"role": "user", "content": prompt.text}])
            return ids, frozenset(stop)
        return ([self.tokenizer.bos_id] if self.cfg.data.add_bos else []) + self.tokenizer.encode(prompt.text), \
            frozenset()

    def _chat(self):
        """The chat encoder of the config's `data.sft` and the ids that end an answer, built once."""
        if self._encoder is None:
            from maester.data.chat import ChatEncoder

            encoder = ChatEncoder(self.tokenizer, self.cfg.data.sft, self.cfg.tokenizer.path)
            self._encoder = encoder, encoder.stop_ids()
        return self._encoder
