"""torch profiler traces per rank and CUDA memory snapshots (`profiling` config section).

Steps are the training loop's global step numbers (1-based). The traced window is `start_step` ..
`start_step + steps - 1`, after `warmup_steps` warm-up steps that run under the profiler but are not recorded.
The loop tells the profiler only which step has just ended, so the first step of a run is learnt from the
first `step(n)` call: a run resumed after the window takes no trace, one resumed inside it traces the steps
that are left.

Files, under `<job dir>/profiles/`:
    step-<first traced step>/rank-<R>.trace.json.gz   Chrome/Perfetto trace (open at ui.perfetto.dev)
    memory/rank-<R>-step-<N>.pickle                  CUDA allocator history after the window (pytorch.org/memory_viz)
    memory/rank-<R>-oom-step-<N>.pickle              the same, when step N ran out of memory
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from maester.config import ProfilingConfig

log = logging.getLogger("maester")

PROFILES_DIR = "profiles"


def steps_text(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


class Profiler:
    """Called by the training loop: `step(n)` after each step n, `on_oom(n)` when step n ran out of memory,
    `close()` at the end. With nothing enabled, every call returns at once."""

    def __init__(self, cfg: ProfilingConfig, job_dir: Path, rank: int, device: torch.device):
        if cfg.memory_snapshot and device.type != "cuda":
            raise ValueError(f"profiling.memory_snapshot = true needs a CUDA device (it records the CUDA caching "
                             f"allocator), and this job trains on {device.type}: set profiling.memory_snapshot = "
                             "false or train on a GPU")
        self.cfg, self.job_dir, self.rank, self.device = cfg, job_dir, rank, device
        self.dir = job_dir / PROFILES_DIR
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1  # the traced window
        self.warmup_from = max(1, cfg.start_step - cfg.warmup_steps)
        self.window = steps_text(self.first, self.last)
        self._trace: torch.profiler.profile | None = None
        self._trace_pending = cfg.enabled  # a trace still to start
        self._snapshot_pending = cfg.memory_snapshot  # the after-the-window snapshot still to dump
        self._traced_from = 0  # the first recorded step of the running trace
        self._discard = False  # drop the trace being stopped instead of writing it
        self._run_first: int | None = None  # the first step this run trained
        self._run_last: int | None = None  # the last step this run finished
        self._active = cfg.enabled or cfg.memory_snapshot  # whether step() has anything left to do
        if cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=cfg.memory_snapshot_max_entries)
        if cfg.enabled and self.warmup_from == 1:
            # The warm-up (or the window) begins with a fresh run's first step, which starts after this returns. A
            # resumed run's first step is a later one; step() throws that recording away.
            self._start_trace(1)

    def step(self, step: int) -> None:
        """Step `step` has ended (its optimizer update is done)."""
        if not self._active:
            return
        if self._run_first is None:
            self._run_first = step
            self._on_first_step(step)
        self._run_last = step
        if self._trace is not None:
            self._trace.step()  # writes the trace after the window's last step
            if step >= self.last:
                self._trace.stop()
                self._trace = None
        elif self._trace_pending and self.warmup_from - 1 <= step < self.last:
            self._start_trace(step + 1)
        if self._snapshot_pending and step >= self.last:
            self._snapshot_pending = False
            self._dump_snapshot(f"rank-{self.rank}-step-{step}.pickle", f"after step {step}")
        self._active = self._trace is not None or self._trace_pending or self._snapshot_pending

    def on_oom(self, step: int) -> None:
        """Step `step` raised `torch.OutOfMemoryError` (the loop re-raises it after this)."""
        if self.cfg.memory_snapshot:
            try:
                self._dump_snapshot(f"rank-{self.rank}-oom-step-{step}.pickle", f"of step {step}, out of memory",
                                    level=logging.WARNING)
            except OSError as e:  # the out-of-memory error stays the one the run reports
                log.error("profiling: could not write the CUDA memory snapshot of step %d: %s", step, e)
        elif self.device.type == "cuda":
            log.info("profiling.memory_snapshot = true records what holds the CUDA memory and dumps it when a "
                     "step runs out of memory")

    def close(self) -> None:
        """Write what a window that training did not reach the end of has recorded, and stop recording.

        The last `ProfilerStep#<N>` marker of such a trace spans what came after the last step (the final
        checkpoint): the profiler opens a step's marker when the step before it ends.
        """
        if self._trace is not None:
            trace, self._trace = self._trace, None
            recording = (self._run_last or 0) + 1 >= self.first  # past the warm-up
            trace.stop()  # writes the trace if it was recording, not in the warm-up
            if not recording:
                log.info("profiling: training ended after step %s, before the traced %s: no trace was taken",
                         self._run_last, self.window)
        self._trace_pending = False
        if self._snapshot_pending:
            self._snapshot_pending = False
            if self._run_last is not None and self._run_last >= self.first:
                self._dump_snapshot(f"rank-{self.rank}-step-{self._run_last}.pickle",
                                    f"after step {self._run_last}, the last of training")
        self._active = False
        if self.cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _on_first_step(self, step: int) -> None:
        """Learn where this run started: a resumed run may have started past the warm-up or the window."""
        if step == 1:
            return
        if self._trace is not None:  # started for step 1, but recorded `step` of a resumed run
            self._discard = True
            self._trace.stop()
            self._trace, self._discard, self._trace_pending = None, False, True
        if self._trace_pending and step >= self.first:
            if step >= self.last:
                self._trace_pending = False
                where = "after" if step > self.last else "at the last of"
                log.info("profiling: this run starts at step %d, %s the traced %s: no trace is taken", step, where,
                         self.window)
            else:
                log.info("profiling: this run starts at step %d, inside the traced %s: tracing %s only", step,
                         self.window, steps_text(step + 1, self.last))
        if self._snapshot_pending and step > self.last:
            self._snapshot_pending = False
            log.info("profiling: this run starts at step %d, after step %d: the CUDA memory snapshot is taken only "
                     "on out-of-memory", step, self.last)

    def _start_trace(self, next_step: int) -> None:
        """Profile from step `next_step` (which has not started yet) to the end of the window."""
        first, last = self.first, self.last

        def action(step: int) -> ProfilerAction:  # `step`: the global number of the step about to run
            if step < next_step or step > last:
                return ProfilerAction.NONE
            if step < first:
                return ProfilerAction.WARMUP
            return ProfilerAction.RECORD if step < last else ProfilerAction.RECORD_AND_SAVE

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type != "cuda":  # kineto of a CUDA build probes for GPUs and logs an ERROR line where none is
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # read when the profiler first starts; 5: USDT only
        trace = torch.profiler.profile(activities=activities, schedule=action, on_trace_ready=self._write_trace,
                                       record_shapes=self.cfg.record_shapes, profile_memory=self.cfg.profile_memory,
                                       with_stack=self.cfg.with_stack)
        # The profiler counts steps from 0; starting it one step early and stepping it once makes its count (and
        # the `ProfilerStep#<N>` markers of the trace) the global step numbers.
        trace.step_num = next_step - 1
        trace.start()
        trace.step()
        self._trace, self._trace_pending, self._traced_from = trace, False, max(next_step, first)

    def _write_trace(self, trace: torch.profiler.profile) -> None:
        """`on_trace_ready`: the recording has stopped; write it gzipped, under a temporary name, then rename."""
        if self._discard:
            return
        out = self.dir / f"step-{self._traced_from}" / f"rank-{self.rank}.trace.json.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".rank-{self.rank}.partial.json.gz")
        trace.export_chrome_trace(str(partial))  # a path ending in .gz is written gzipped
        os.replace(partial, out)
        to = max(self._run_last or self._traced_from, self._traced_from)
        log.info("profiling: wrote the trace of %s to %s", steps_text(self._traced_from, to), out)

    def _dump_snapshot(self, name: str, why: str, level: int = logging.INFO) -> None:
        """The CUDA allocator's state and recorded history, pickled under a temporary name, then renamed."""
        out = self.dir / "memory" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{name}.partial")
        torch.cuda.memory._dump_snapshot(str(partial))
        os.replace(partial, out)
        log.log(level, "profiling: wrote the CUDA memory snapshot %s to %s", why, out)
