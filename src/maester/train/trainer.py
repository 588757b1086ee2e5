"""The training loop: build everything from the config, resume if the job has a checkpoint, train, log, save."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from maester.config import Config
from maester.data.loader import IGNORE_INDEX, build_loader
from maester.data.tokenizers import build_tokenizer
from maester.models.build import build_on_meta, count_parameters, materialize, resolve_args
from maester.train.checkpoint import Checkpointer, load_model_weights, resolve_checkpoint
from maester.train.faults import maybe_crash
from maester.train.loss import cross_entropy_sum
from maester.train.metrics import MetricsWriter, device_peak_flops, model_flops_per_token, peak_memory_gib
from maester.train.optim import build_optimizer
from maester.train.schedule import lr_multiplier

log = logging.getLogger("maester")


@dataclass
class TrainResult:
    step: int
    loss: float | None
    checkpoint: Path | None


def select_device(cfg: Config) -> torch.device:
    want = cfg.training.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("training.device = 'cuda' but no CUDA/ROCm device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def autocast_context(cfg: Config, device: torch.device):
    precision = cfg.training.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_single_process_layout(cfg: Config) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ValueError(f"launched with WORLD_SIZE={world}, but this trainer runs one process: "
                         f"use --nproc_per_node=1 (multi-process layouts are not supported yet)")
    p = cfg.parallel
    shard = 1 if p.dp_shard == -1 else p.dp_shard
    needed = p.dp_replicate * shard * p.tp
    if needed != 1:
        raise ValueError(f"parallel layout dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x tp={p.tp} "
                         f"needs {needed} processes, but this trainer runs one: set all degrees to 1 "
                         f"(dp_shard may stay -1)")


def setup_logging(job_dir: Path | None = None) -> None:
    root = logging.getLogger("maester")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    if job_dir is not None:
        (job_dir / "logs").mkdir(parents=True, exist_ok=True)
        path = (job_dir / "logs" / "train.log").resolve()
        if not any(getattr(h, "baseFilename", None) == str(path) for h in root.handlers):
            fh = logging.FileHandler(path)
            fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            root.addHandler(fh)


class Trainer:
    def __init__(self, cfg: Config, job_dir: Path):
        self.cfg, self.job_dir = cfg, Path(job_dir)
        setup_logging(self.job_dir)
        check_single_process_layout(cfg)
        seed_everything(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        self.device = select_device(cfg)

        self.tokenizer = build_tokenizer(cfg.tokenizer)
        args = resolve_args(cfg.model, self.tokenizer.vocab_size)
        self.model = materialize(build_on_meta(cfg.model, args), self.device, cfg.training.seed)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.base_lrs = [cfg.optimizer.lr for _ in self.optimizer.param_groups]

        t = cfg.training
        self.loader = build_loader(cfg.data, self.tokenizer, seed=t.seed,
                                   global_batch=cfg.sequences(t.global_batch_size),
                                   micro_batch=cfg.sequences(t.micro_batch_size))
        self.checkpointer = Checkpointer(self.job_dir, cfg.checkpoint)
        self.step, self.tokens_seen = 0, 0
        self._resume_or_initialise()
        log.info("model %s/%s: %s parameters; %d accumulation step(s) of %d sequence(s) x %d tokens; device %s",
                 cfg.model.name, cfg.model.flavor, f"{count_parameters(self.model):,}",
                 self.loader.accumulation_steps, self.loader.micro_batch, cfg.data.seq_len, self.device)

    def _resume_or_initialise(self) -> None:
        latest = self.checkpointer.latest()
        if latest is not None:
            state = self.checkpointer.load(latest, self.model, self.optimizer)
            self.step = state["step"]
            self.tokens_seen = state.get("tokens_seen", 0)
            self.loader.load_state_dict(state["data"])
            log.info("resumed from %s at step %d", latest, self.step)
        elif self.cfg.checkpoint.init_from:
            source = resolve_checkpoint(self.cfg.checkpoint.init_from)
            load_model_weights(source, self.model)
            log.info("initialised model weights from %s", source)

    def train(self) -> TrainResult:
        cfg, model, optimizer = self.cfg, self.model, self.optimizer
        total = cfg.training.steps
        if self.step >= total:
            log.info("already at step %d of %d: nothing to train", self.step, total)
            return TrainResult(self.step, None, self.checkpointer.latest())
        from tqdm import tqdm

        progress = tqdm(total=total, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not sys.stderr.isatty())
        writer = MetricsWriter(self.job_dir / "metrics.jsonl", progress)
        flops_per_token = model_flops_per_token(model, cfg.data.seq_len)
        peak = device_peak_flops(self.device)
        max_norm = cfg.training.max_grad_norm or math.inf
        params = [p for p in model.parameters() if p.requires_grad]
        last_checkpoint, loss_value = None, None
        window_tokens, window_data_s, window_start = 0, 0.0, time.perf_counter()
        model.train()
        try:
            while self.step < total:
                t0 = time.perf_counter()
                micro_batches = [b.to(self.device) for b in self.loader.next_step()]
                window_data_s += time.perf_counter() - t0
                self.step += 1
                for group, base in zip(optimizer.param_groups, self.base_lrs):
                    group["lr"] = base * lr_multiplier(cfg.schedule, self.step, total)

                loss = self._forward_backward(micro_batches)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=self.device.type != "mps")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step_tokens = sum(b.num_tokens for b in micro_batches)
                window_tokens += step_tokens
                self.tokens_seen += step_tokens
                progress.update(1)

                if self.step % cfg.logging.interval == 0 or self.step in (1, total):
                    loss_value = loss.item()  # the only host sync of the step, on logging steps only
                    elapsed = time.perf_counter() - window_start
                    tps = window_tokens / elapsed
                    writer.write({
                        "step": self.step, "loss": loss_value, "lr": optimizer.param_groups[0]["lr"],
                        "grad_norm": grad_norm.item(), "tokens_per_second": tps,
                        "mfu": tps * flops_per_token / peak if peak else None,
                        "data_loading_seconds": window_data_s, "data_loading_share": window_data_s / elapsed,
                        "peak_memory_gib": peak_memory_gib(self.device), "tokens_seen": self.tokens_seen,
                        "epoch": self.loader.epoch,
                    })
                    window_tokens, window_data_s, window_start = 0, 0.0, time.perf_counter()

                if self._checkpoint_due():
                    last_checkpoint = self.checkpointer.save(
                        self.step, model, optimizer,
                        {"data": self.loader.state_dict(), "tokens_seen": self.tokens_seen}, cfg.to_json())
                    log.info("saved checkpoint %s", last_checkpoint)
                maybe_crash("after_step", self.step)
        finally:
            progress.close()
            writer.close()
        return TrainResult(self.step, loss_value, last_checkpoint or self.checkpointer.latest())

    def _forward_backward(self, micro_batches) -> torch.Tensor:
        """Loss normalised by the label tokens of the whole step, so the split into micro-batches is irrelevant."""
        n_labels = sum((b.labels != IGNORE_INDEX).sum() for b in micro_batches).clamp(min=1)
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            with autocast_context(self.cfg, self.device):
                logits = self.model(batch.input_ids, batch.position_ids, batch.document_ids)
            loss = cross_entropy_sum(logits, batch.labels) / n_labels
            loss.backward()
            total += loss.detach()
        return total

    def _checkpoint_due(self) -> bool:
        c = self.cfg.checkpoint
        if c.interval and self.step % c.interval == 0:
            return True
        return c.save_final and self.step == self.cfg.training.steps
