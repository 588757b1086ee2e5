"""The training loop: build everything from the config, resume if the job has a checkpoint, train, log, save;
stop early and cleanly when asked to (`maester.train.preemption`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from maester.config import Config
from maester.data.batch import IGNORE_INDEX
from maester.data.downloads import VERIFIED as VERIFIED_DOWNLOADS, verify_downloaded
from maester.data.loader import build_loader
from maester.data.tokenizers import build_tokenizer
from maester.models.build import build_model, count_parameters
from maester.parallel.devices import describe_environment
from maester.parallel.context_parallel import context_parallel_of
from maester.parallel.dims import ParallelDims, init_distributed, set_collective_timeout, set_cpu_threads
from maester.parallel.float8 import Float8Training, check_float8
from maester.parallel.hosts import gather_hosts, hosts_event
from maester.parallel.parallelize import uses_loss_parallel
from maester.parallel.precision import autocast, resolve_precision
from maester.progress import progress_bar
from maester.train.checkpoint import Checkpointer
from maester.train.checkpoint_async import SaveResult, background_group, resolve_async_mode
from maester.train.checkpoint_dirs import check_seedable
from maester.train.checkpoint_files import read_trainer_state
from maester.train.downstream import DownstreamEvaluation, evaluate_downstream
from maester.train.faults import fault_at, maybe_crash, maybe_hang
from maester.train.grad_scaler import LossScaler
from maester.train.hf_weights import fetch_before_process_group
from maester.train.init_from import check_steps_left, resolve_init_from
from maester.models.moe import moe_metrics, update_expert_bias
from maester.train.metrics import (
    MetricsWindow,
    MetricsWriter,
    batch_statistics,
    device_peak_flops,
    model_flops_per_token,
    open_metrics,
    peak_memory_gib,
)
from maester.train.nonfinite import AfterLoadWatch, NonFiniteError, NonFiniteGuard, skips_on_device
from maester.train.optim import build_optimizer, clip_grad_norm, full_value
from maester.train.preemption import (
    REQUEUE_FILE,
    StopRequests,
    clear_markers_of_earlier_runs,
    mark_completed,
    stop_event,
)
from maester.train.profiling import Profiler
from maester.train.run_start import start
from maester.train.schedule import lr_multiplier, warmup_clamped
from maester.train.setup import build_training_model, seed_everything, setup_logging

log = logging.getLogger("maester")


@dataclass
class TrainResult:
    step: int
    loss: float | None
    checkpoint: Path | None
    stop_reason: str | None = None
    """Why training stopped before `training.steps` (a signal or the stop file); None: it reached the end."""


@dataclass
class _Run:
    """What one call of `Trainer.train` keeps between its steps."""

    total: int
    writer: MetricsWriter | None  # rank 0's only
    profiler: Profiler
    progress: object
    stops: StopRequests
    window: MetricsWindow
    long_timeout: bool  # training.init_timeout_seconds still applies (until the first step and evaluation)
    flops_per_token: int
    peak_flops: float | None
    first_step: int  # logged whatever logging.interval says: step 1, or the first after step_offset or init_from
    evaluated: bool = False
    last_checkpoint: Path | None = None  # the newest complete one this run wrote
    failed_save: SaveResult | None = None  # the newest save, where it failed
    loss_value: float | None = None
    stop_reason: str | None = None


class Trainer:
    def __init__(self, cfg: Config, job_dir: Path):
        self.cfg, self.job_dir = cfg, Path(job_dir)
        if cfg.checkpoint.init_from_hf is not None:  # a Hub download runs under no collective timeout
            fetch_before_process_group(cfg.checkpoint.init_from_hf)
        self.rank, self.world_size, self.device = init_distributed(cfg.training.device,
                                                                   cfg.training.init_timeout_seconds,
                                                                   cfg.training.precision, cfg.parallel.force_fsdp)
        setup_logging(self.job_dir, self.rank, per_rank_file=cfg.logging.per_rank_files)
        threads = set_cpu_threads(cfg.training.cpu_threads, self.device)
        log.info("environment: %s%s", describe_environment(self.device), f", {threads}" if threads else "")
        self.hosts = gather_hosts()  # each rank's hostname, for the log and metrics.jsonl
        self.dims = ParallelDims.from_config(cfg, self.world_size)  # refuses bad layouts before any work
        check_float8(cfg, self.dims, self.device)  # a GPU without float8, DDP, a torchao that does not fit torch
        if cfg.preflight.enabled:  # check the collectives before anything is built; fail_fast raises PreflightFailed
            from maester.parallel.preflight import run_preflight

            run_preflight(cfg.preflight, self.job_dir, self.device, fail_fast=cfg.preflight.fail_fast)
        seed_everything(cfg.training.seed)
        torch.set_float32_matmul_precision(cfg.training.matmul_precision)
        if cfg.training.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.precision = resolve_precision(cfg.training.precision, cfg.parallel.param_dtype, self.device.type,
                                           self.dims.fsdp_enabled)
        async_mode = resolve_async_mode(cfg.checkpoint.async_mode, self.device.type)
        self.checkpointer = Checkpointer(self.job_dir, cfg.checkpoint, self.rank, async_mode,
                                         background_group(async_mode, cfg.training.init_timeout_seconds))
        self._latest, self.damaged_checkpoints = self.checkpointer.resume_point()  # rank 0's choice, on every rank
        # A resume overwrites every weight and restores the RNG: the random init would be work thrown away.
        self._resuming = self._latest is not None and not read_trainer_state(self._latest).get("seed_checkpoint")
        self._init_source = None if self._latest else resolve_init_from(cfg)  # checks and load read the same one
        check_steps_left(cfg, self._init_source)
        self.model = build_training_model(cfg, self.tokenizer.vocab_size, self.dims, self.device, self.precision,
                                          initialise=not self._resuming)
        # Parameters and FLOPs are counted on the whole model: under pp this rank holds some stages only.
        self.whole_model = getattr(self.model, "whole_model", self.model)
        # fp16: the loss scaler, made with the parameters, on their device
        self.scaler = LossScaler(next(iter(self.model.parameters())).device) if self.precision.loss_scaling else None
        self.loss_parallel = uses_loss_parallel(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device, log_groups=True)
        self.checkpointer.fit_host_memory(cfg.checkpoint.async_mode, self.model, self.optimizer)
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]  # before a checkpoint's are loaded
        self._params = [p for p in self.model.parameters() if p.requires_grad]  # the ones clipping sees
        self.dp_group = self.dims.submesh("dp").get_group() if self.world_size > 1 else None
        # Context parallel: each cp rank holds a share of its dp rank's loss; the loss sums over dp x cp.
        self.context_parallel = context_parallel_of(self.model)
        self.loss_group = self.dims.submesh("dp_cp").get_group() if self.dims.cp > 1 else self.dp_group
        self.pp_group = self.dims.mesh["pp"].get_group() if self.dims.pp > 1 else None
        self.pipeline = None  # parallel.pp > 1: the schedule that runs this rank's stages
        if self.pp_group is not None:
            from maester.parallel.pipeline import Pipeline

            self.pipeline = Pipeline(self.model, cfg.parallel.pp_schedule,
                                     self.dims.batch_plan(cfg).accumulation_steps, self.pp_group)
        # Flags for the optimizer live with the parameters: on the CPU under parallel.cpu_offload.
        param_device = next(iter(self.model.parameters())).device
        self.nonfinite = NonFiniteGuard(cfg.training.nonfinite, cfg.training.max_skipped_steps, self.optimizer,
                                        param_device, self.loss_group)
        if self.rank == 0 and cfg.data.verify_downloads:  # a swapped file of a download is an error, not data
            verify_downloaded(cfg.data, self.job_dir / VERIFIED_DOWNLOADS)
        self.loader = build_loader(cfg.data, cfg.tokenizer, self.tokenizer, seed=cfg.training.seed,
                                   batch=self.dims.batch_plan(cfg), group=self.dp_group)
        self.step, self.tokens_seen = 0, 0
        self.schedule_start = 0  # steps done before the LR schedule began (its warmup starts at the next step)
        self.provenance: dict = {}  # init_from and load_mode, where the run began from another checkpoint
        self.after_load: AfterLoadWatch | None = None  # the first steps after a checkpoint was loaded
        self._validation = None
        # evaluation.tasks: lm-eval tasks on this sharded model
        self.downstream = DownstreamEvaluation(cfg, self.model, self.tokenizer, self.dims, self.device,
                                               self.precision) if cfg.evaluation.tasks else None
        self.loaded = start(self)  # resume or initialise (float8 below: from the weights in place); the `load` event
        self.float8 = Float8Training(self.model, cfg.parallel.cpu_offload) if cfg.training.float8.enabled else None
        log.info("model %s/%s: %s parameters; %d process(es): dp_replicate %d x dp_shard %d (ep %d) x cp %d x tp %d "
                 "x pp %d; %d accumulation step(s) of %d sequence(s) x %d tokens per dp rank; device %s",
                 cfg.model.name, cfg.model.flavor, f"{count_parameters(self.whole_model):,}", self.world_size,
                 self.dims.dp_replicate, self.dims.dp_shard, self.dims.ep, self.dims.cp, self.dims.tp, self.dims.pp,
                 self.loader.batch.accumulation_steps,
                 self.loader.batch.micro_batch, cfg.data.seq_len, self.device)


    def train(self) -> TrainResult:
        """Train to `training.steps`: each step takes its batches, sets the LR and steps the optimizer; then the
        objects that know say whether logging, evaluation, a checkpoint or a stop is due."""
        if self.step >= self.cfg.training.steps:
            return self._nothing_to_train()
        with self._run() as run:
            while self.step < run.total:
                batches, stats = self._next_batches(run.window)
                self.step += 1
                lr_mult = self._set_lr(run.total)
                loss, grad_norm = self._optimizer_step(batches, stats, run.profiler)
                self._finish_step(run, batches)
                if self.after_load is not None and self.after_load.check(self.step, self.checkpointer, run.writer):
                    self.after_load = None
                if self._logging_due(run):
                    run.loss_value = self._log(run, loss, grad_norm, lr_mult)
                self._evaluate_if_due(run)
                if self._checkpoint_due():  # the last step's save is written before the run ends
                    self._save_checkpoint(run, background=self.step < run.total)
                self._record_saves(run)
                maybe_crash("after_step", self.step)
                if self._stopped_on_request(run):
                    break
            run.stops.drain()
            self._record_saves(run, wait=True)
            if run.failed_save is not None:
                raise ValueError(f"ended at step {self.step} without its last checkpoint: {run.failed_save.error}")
        if run.stop_reason is None and self.rank == 0:
            mark_completed(self.job_dir, self.step, run.last_checkpoint or self.checkpointer.latest())
        return TrainResult(self.step, run.loss_value, run.last_checkpoint or self.checkpointer.latest(),
                           run.stop_reason)

    def _nothing_to_train(self) -> TrainResult:
        log.info("already at step %d of %d: nothing to train", self.step, self.cfg.training.steps)
        if self.rank == 0:  # a run that ended between its last checkpoint and the marker
            mark_completed(self.job_dir, self.step, self.checkpointer.latest())
        return TrainResult(self.step, None, self.checkpointer.latest())

    @contextlib.contextmanager
    def _run(self):
        """What one call of `train` holds between steps (`_Run`), set up before the first step and closed after the
        last, however the loop ends."""
        cfg, total = self.cfg, self.cfg.training.steps
        if self.rank == 0:
            clear_markers_of_earlier_runs(self.job_dir, self.step, total)
        clamped = warmup_clamped(cfg.schedule, total - self.schedule_start)
        if clamped:
            log.warning(clamped)
        profiler = Profiler(cfg.profiling, self.job_dir, self.rank, self.device)
        progress = progress_bar("train", total=total, initial=self.step, unit="step",
                                disable=True if self.rank != 0 else None)
        writer = open_metrics(cfg, self.job_dir, progress, self.step) if self.rank == 0 else None
        events = [hosts_event(self.hosts, self.step)] + [{"event": "checkpoint_damaged", "step": self.step, **record}
                                                         for record in self.damaged_checkpoints] + [self.loaded or {}]
        for record in events if writer is not None else ():
            if record:
                writer.write_event(record)
        run = _Run(total, writer, profiler, progress, StopRequests(self.job_dir, self.rank),
                   MetricsWindow(self.device), long_timeout=self.world_size > 1,
                   flops_per_token=model_flops_per_token(self.whole_model, cfg.data.seq_len),
                   peak_flops=device_peak_flops(self.device), first_step=1 if self._resuming else self.step + 1)
        self.model.train()
        gc_interval = cfg.training.gc_interval
        if gc_interval:  # collected every gc_interval steps on all ranks at once, not whenever a rank's count says
            gc.disable()
            gc.collect()
        run.stops.install()  # signal handlers that only set a flag, until training ends
        try:
            yield run
        except NonFiniteError as e:
            self.checkpointer.wait()
            latest = self.checkpointer.latest()
            raise NonFiniteError(f"{e}; latest checkpoint: {latest or 'none'}", e.step) from None
        finally:
            self.checkpointer.close()  # a save in flight is finished (or fails) before the process goes on
            self._record_saves(run)
            if gc_interval:
                gc.enable()
            run.stops.restore()
            profiler.close()
            self.loader.close()
            progress.close()
            if writer is not None:
                writer.close()

    def _next_batches(self, window: MetricsWindow) -> tuple[list, torch.Tensor]:
        """This rank's micro-batches of the next step, on the device, and their statistics (device tensors)."""
        t0 = time.perf_counter()
        host_batches = self.loader.next_step()
        window.data_seconds += time.perf_counter() - t0
        micro_batches = [b.to(self.device) for b in host_batches]
        stats = batch_statistics(micro_batches, self.device)
        window.add_batches(stats)
        return micro_batches, stats

    def _set_lr(self, total: int) -> float:
        lr_mult = lr_multiplier(self.cfg.schedule, self.step - self.schedule_start, total - self.schedule_start)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * lr_mult
        return lr_mult

    def _optimizer_step(self, micro_batches, stats: torch.Tensor, profiler: Profiler):
        """Forward and backward over the micro-batches, clip, and step (unless the step is non-finite or the fp16
        scale overflowed); returns (loss, grad norm) as device tensors."""
        max_norm = self.cfg.training.max_grad_norm or math.inf
        try:
            loss = self._forward_backward(micro_batches, stats[0])
            grad_norm, overflow = clip_grad_norm(self._params, max_norm, self.scaler, self.pp_group)
            if self.after_load is not None:
                self.after_load.observe(self.step, loss, grad_norm, overflow)
            if overflow is None:
                if self.nonfinite.observe(self.step, loss, grad_norm):
                    self.optimizer.step()
            else:  # fp16: an overflow is the scaler's to handle, not a non-finite step
                self._scaled_step(loss, grad_norm, overflow)
            update_expert_bias(self.model, self.dp_group)  # MoE's auxiliary-loss-free balancing; else nothing
            if self.float8 is not None:
                self.float8.after_optimizer_step()
        except torch.OutOfMemoryError:
            profiler.on_oom(self.step)
            raise
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _finish_step(self, run: _Run, micro_batches) -> None:
        """The profiler's and the garbage collector's turn, a fault point, and the step's tokens counted."""
        run.profiler.step(self.step)
        gc_interval = self.cfg.training.gc_interval
        if gc_interval and self.step % gc_interval == 0:
            gc.collect(1)
        maybe_hang(self.step)
        step_tokens = sum(b.num_tokens for b in micro_batches) * self.dims.dp_size
        run.window.add_step(step_tokens)
        self.tokens_seen += step_tokens
        run.progress.update(1)

    def _log(self, run: _Run, loss: torch.Tensor, grad_norm: torch.Tensor, lr_mult: float) -> float:
        """The metrics record of the window that ends at this step (collectives: every rank calls it); written by
        rank 0. Returns the step's loss, the only host read of the step."""
        if self.loss_group is not None:  # each rank holds its share of the step's loss
            dist.all_reduce(loss, group=self.loss_group)
        loss_value = loss.item()
        skipped = self.nonfinite.check()
        window = run.window
        elapsed, tps = window.throughput()
        record = {
            "step": self.step, "loss": loss_value, "lr": self.cfg.optimizer.lr * lr_mult,
            **{f"lr/{g['name']}": g["lr"] for g in self.optimizer.param_groups if "name" in g},
            "grad_norm": grad_norm.item(), "tokens_per_second": tps, "step_seconds": elapsed / max(window.steps, 1),
            **({"grad_scale": self.scaler.scale.item()} if self.scaler is not None else {}),
            "mfu": tps / self.world_size * run.flops_per_token / run.peak_flops if run.peak_flops else None,
            "data_loading_seconds": window.data_seconds, "data_loading_share": window.data_seconds / elapsed,
            "peak_memory_gib": peak_memory_gib(self.device), "tokens_seen": self.tokens_seen,
            **({"skipped_steps": skipped} if self.cfg.training.nonfinite == "skip" else {}),
            **window.batch_metrics(self.dp_group),
            **moe_metrics(self.model, self.dp_group),
        }
        for name, counts in self.loader.source_metrics().items():  # collective: every rank calls it
            record.update({f"data/{name}/{k}": v for k, v in counts.items()})
        if run.writer is not None:
            run.writer.write(record)
        window.reset()
        return loss_value

    def _logging_due(self, run: _Run) -> bool:
        """Every `logging.interval` steps, the first and the last, and every step that evaluates (its row holds
        both)."""
        step, cfg = self.step, self.cfg
        validation = cfg.logging.eval_interval and step % cfg.logging.eval_interval == 0
        downstream = self.downstream is not None and self.downstream.due(step, run.total)
        return step % cfg.logging.interval == 0 or step in (run.first_step, run.total) or bool(validation or downstream)

    def _evaluate_if_due(self, run: _Run) -> None:
        """The validation loss every `logging.eval_interval` steps, the downstream tasks every `evaluation.interval`,
        both at the end, their time kept out of the steps' throughput; after the first step (and evaluation),
        shorten the collective timeout: building, compiling and the first evaluation's recompiles are behind."""
        cfg, start = self.cfg, time.perf_counter()
        if cfg.logging.eval_interval and (self.step % cfg.logging.eval_interval == 0 or self.step == run.total):
            validation, run.evaluated = self.evaluate(), True
            if run.writer is not None:
                run.writer.write_eval({"step": self.step, **validation})
        if self.downstream is not None and self.downstream.due(self.step, run.total):
            evaluate_downstream(self.downstream, self.step, run.writer)
        if run.writer is not None:
            run.writer.end_step()  # the step's row, its evaluations merged in
        run.window.exclude(time.perf_counter() - start)
        if run.long_timeout and (run.evaluated or not cfg.logging.eval_interval):
            set_collective_timeout(cfg.training.train_timeout_seconds, self.dims.process_groups(), device=self.device)
            run.long_timeout = False

    def _stopped_on_request(self, run: _Run) -> bool:
        """Whether the ranks agree to stop here (a signal or the stop file); if so, with a checkpoint of this step
        and the requeue marker. After the last step the run is complete, whatever was asked."""
        run.stop_reason = run.stops.agree() if self.step < run.total else None
        if run.stop_reason is None:
            return False
        self._record_saves(run, wait=True)  # this step's own save may be in flight: it counts once it is complete
        if run.last_checkpoint is None or run.last_checkpoint.name != f"step-{self.step}":
            self._save_checkpoint(run, background=False)
        if run.writer is not None:  # what `maester status` counts as a requeue or a stopped link
            run.writer.write_event(stop_event(self.step, run.stop_reason, run.last_checkpoint))
        run.stops.acknowledge(self.step, run.stop_reason, run.last_checkpoint)
        log.info("stopped on request (%s) after step %d of %d with checkpoint %s; wrote %s", run.stop_reason,
                 self.step, run.total, run.last_checkpoint, self.job_dir / REQUEUE_FILE)
        return True

    def _save_checkpoint(self, run: _Run, background: bool) -> None:
        """Save this step; `background` (checkpoint.async_mode async or pinned): staged, then written by a thread."""
        self.nonfinite.check()  # a run that went non-finite under `stop` raises here, before the damage is saved
        path = self.checkpointer.save(
            self.step, self.model, self.optimizer,
            {"data": self.loader.state_dict(), "tokens_seen": self.tokens_seen,
             "schedule_start": self.schedule_start, **self.provenance,
             **({"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {})}, self.cfg.to_json(),
            background=background)
        log.info("staged checkpoint %s; writing it in the background" if background and
                 self.checkpointer.async_mode != "off" else "saved checkpoint %s", path)
        self._record_saves(run)

    def _record_saves(self, run: _Run, wait: bool = False) -> None:
        """The saves that ended (`wait`: the one in flight too): the newest complete is `run.last_checkpoint`, a failed
        one `run.failed_save` until a later one succeeds; rank 0 writes each one's event line into events.jsonl."""
        for result in self.checkpointer.collect(wait):
            if result.error is None:
                run.last_checkpoint, run.failed_save = result.path, None
            else:
                run.failed_save = result
            if run.writer is not None:
                run.writer.write_event(result.event(), sink_step=self.step)

    def _forward_backward(self, micro_batches, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step loss: token losses summed, divided by the label tokens of the whole step
        over all data-parallel ranks, so neither the micro-batch split nor the number of ranks changes it.

        FSDP and DDP average gradients over the data-parallel ranks (FSDP over the cp ranks too); the backward loss
        is scaled by their number to turn that average into the sum the normalisation needs. `labels`: this dp
        rank's label tokens in the step, a tensor on the device counted with the step's other statistics (no host
        read). Under context parallel each rank takes its own tokens of every micro-batch.
        """
        n_labels = labels.to(torch.int64)
        if self.dp_group is not None:
            dist.all_reduce(n_labels, group=self.dp_group)
        n_labels = n_labels.clamp(min=1)
        scale = self.dims.dp_size * self.dims.cp if (self.dims.fsdp_enabled or self.dims.ddp_enabled) else 1
        if self.scaler is not None:
            scale = self.scaler.scale * scale
        nan = fault_at("nan_loss", self.step)
        anomaly = torch.autograd.detect_anomaly(check_nan=True) if self.cfg.training.detect_anomaly else \
            contextlib.nullcontext()
        if self.pipeline is not None:  # the schedule runs the micro-batches through the stages
            with self._loss_context(), autocast(self.precision, self.device), anomaly:
                return self.pipeline.step(micro_batches, n_labels, scale, self.device, poison=nan)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            if self.dims.ddp_enabled:  # DDP all-reduces the gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            if self.context_parallel is not None:
                batch = self.context_parallel.shard(batch)
            with self._loss_context(), autocast(self.precision, self.device), anomaly:
                loss = self.model(batch.input_ids, batch.position_ids, batch.document_ids,
                                  labels=batch.labels, document_offsets=batch.document_offsets) / n_labels
                if nan:
                    loss = loss * float("nan")
                (loss * scale).backward()
            total += full_value(loss.detach())
        return total

    def _scaled_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, overflow: torch.Tensor) -> None:
        """fp16: step unless the scaled gradients overflowed (or the non-finite guard says skip), then update the
        scale. Fused optimizers skip on the device (`found_inf`); others read the flag (one sync per step)."""
        optimizer = self.optimizer
        if self.nonfinite.observe(self.step, loss, torch.where(overflow > 0, 0.0, grad_norm)):
            found = getattr(optimizer, "found_inf", None) if self.nonfinite.on_device else None
            skip = overflow if found is None else torch.maximum(found, overflow)
            if skips_on_device(optimizer):
                optimizer.found_inf = skip
                optimizer.step()
            elif not bool(skip.item()):
                optimizer.step()
        self.scaler.update(overflow)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss per label token and perplexity over all held-out data (`val_loss`, `val_perplexity`), and per
        `data.validation` source (`val/<name>/loss`, `val/<name>/perplexity`). Every rank takes the same number of
        batches, so sharded forwards stay in step."""
        if self._validation is None:
            self._validation = self._validation_sets()
        self.model.eval()
        totals = torch.zeros(len(self._validation), 2, device=self.device)
        for i, batches in enumerate(self._validation.values()):
            for batch in batches:
                batch = batch.to(self.device)
                if self.context_parallel is not None:
                    batch = self.context_parallel.shard(batch)
                with self._loss_context(), autocast(self.precision, self.device):
                    if self.pipeline is not None:  # through the stages in turn
                        loss_sum = self.pipeline.evaluate(batch, self.device)
                    else:
                        loss_sum = self.model(batch.input_ids, batch.position_ids, batch.document_ids,
                                              labels=batch.labels, document_offsets=batch.document_offsets)
                    totals[i, 0] += full_value(loss_sum.detach())
                totals[i, 1] += (batch.labels != IGNORE_INDEX).sum()
        self.model.train()
        if self.loss_group is not None:
            dist.all_reduce(totals, group=self.loss_group)
        rows = totals.tolist()

        def loss_and_perplexity(loss_sum: float, labels: float) -> tuple[float, float]:
            loss = loss_sum / max(labels, 1)
            return loss, math.exp(min(loss, 700.0))

        out = dict(zip(("val_loss", "val_perplexity"), loss_and_perplexity(*map(sum, zip(*rows)))))
        for name, (loss_sum, labels) in zip(self._validation, rows):
            if name is not None:
                out[f"val/{name}/loss"], out[f"val/{name}/perplexity"] = loss_and_perplexity(loss_sum, labels)
        return out

    def _validation_sets(self) -> dict[str | None, list]:
        """This rank's batches of the sources' held-out split (key None) and of each `data.validation` source."""
        from maester.data.loader import validation_source_batches

        data, batch = self.cfg.data, self.loader.batch
        micro = batch.micro_batch
        sets: dict[str | None, list] = {}
        if any(s.validation_fraction for s in data.sources):
            sets[None] = self.loader.validation_batches(micro)
            if not sets[None]:  # the same on every rank: each gets an equal share of the windows
                raise ValueError("logging.eval_interval is set, but the held-out split of the data sources has "
                                 "too few windows for every data-parallel rank (set validation_fraction on a source)")
        for source in data.validation:
            sets[source.display_name()] = validation_source_batches(source, data, self.tokenizer, micro,
                                                                    batch.dp_rank, batch.dp_size)
        return sets

    def _loss_context(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _checkpoint_due(self) -> bool:
        c = self.cfg.checkpoint
        if c.interval and self.step % c.interval == 0:
            return True
        return c.save_final and self.step == self.cfg.training.steps


def write_seed_checkpoint(cfg: Config, job_dir: Path) -> Path:
    """Initialise the model once, on one process, and save it as `step-0`: every layout that then trains the job
    starts from the same weights, so runs on different layouts are comparable."""
    check_seedable(job_dir)
    setup_logging(job_dir)
    checkpointer = Checkpointer(job_dir, cfg.checkpoint)
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, tokenizer.vocab_size, torch.device("cpu"), cfg.training.seed, cfg.mup)
    path = checkpointer.save(0, model, None, {"seed_checkpoint": True}, cfg.to_json())
    log.info("wrote seed checkpoint %s", path)
    return path
