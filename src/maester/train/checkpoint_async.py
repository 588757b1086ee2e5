"""Asynchronous checkpoint saves (`checkpoint.async_mode`): the mode a run uses, the process group of the background
writes, the host buffers a save is staged into, the one save in flight and how each save went. `Checkpointer`
(checkpoint.py) is a `BackgroundSaves`: it decides what a save writes and how; this module keeps the save in flight."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("maester")


@dataclass
class SaveResult:
    """How one save went, for the metrics. `background`: written by the save's thread while training went on.
    `blocked_seconds`: the loop's time in `save` (the wait for the previous save,
    the state dict, staging, and a synchronous save's write). `write_seconds`: from the first DCP file to `latest`
    moved; `phases` splits it. `error`: why the save failed (None: the checkpoint is complete)."""

    step: int
    path: Path
    background: bool
    blocked_seconds: float = 0.0
    write_seconds: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def event(self) -> dict:
        """Its events.jsonl line: `checkpoint` (complete) or `checkpoint_failed`, at the checkpoint's step."""
        record = {"event": "checkpoint" if self.error is None else "checkpoint_failed", "step": self.step,
                  "checkpoint": self.path.name, "background": self.background,
                  "checkpoint_blocked_seconds": round(self.blocked_seconds, 4)}
        if self.write_seconds is not None:
            record["checkpoint_write_seconds"] = round(self.write_seconds, 4)
        if self.error is not None:
            record["error"] = self.error
        return record


class Phases:
    """Seconds per part of a write, into `SaveResult.phases`."""

    def __init__(self, result: SaveResult):
        self.result = result
        self.start = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.result.phases[name] = now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def resolve_async_mode(setting: str, device_type: str) -> str:
    """`checkpoint.async_mode` for a run on `device_type`: `auto` is `async` on CUDA (the staging copy from the GPU
    is several times faster than the disk) and `off` elsewhere (`async` on the CPU too under the test switch of
    `maester.gpu_defaults`); `pinned` needs CUDA and is refused elsewhere. Whether the host copies fit is decided
    once the model is built (`BackgroundSaves.fit_host_memory`)."""
    from maester.gpu_defaults import resolves_as

    if setting == "auto":
        return "async" if resolves_as(device_type) == "cuda" else "off"
    if setting == "pinned" and device_type != "cuda":
        raise ValueError(f"checkpoint.async_mode = 'pinned' stages checkpoints in page-locked host memory for fast "
                         f"copies from a GPU, which needs CUDA; this run trains on {device_type}: use 'async' "
                         f"(staging in ordinary host memory) or 'off'")
    return setting


def background_group(async_mode: str, timeout_s: float):
    """A gloo group of all ranks for the collectives of background writes, apart from the training's, so that the
    loop and the writing thread never share a group (torchtitan's CheckpointManager and OLMo-core's checkpointer
    make one too); None in one process or with `async_mode` off. A collective call: every rank makes it."""
    import torch.distributed as dist

    if async_mode == "off" or not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from datetime import timedelta

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class BackgroundSaves:
    """At most one save in flight, written by one thread from host buffers that are kept from save to save.
    `async_mode`: `off`, `async` or `pinned` (see `resolve_async_mode`)."""

    def __init__(self, async_mode: str):
        self.async_mode = async_mode
        self.finished: list[SaveResult] = []
        """The saves that ended, complete or failed, since the caller last emptied the list."""
        self._in_flight: tuple[SaveResult, Future] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager = None  # DCP's stager, which keeps its buffers from save to save

    def fit_host_memory(self, setting: str, model, optimizer) -> None:
        """Keep background saves only where each node's host copies fit its memory (`checkpoint_memory`): `auto`
        (`setting`) then saves synchronously, saying so; an explicit `async` or `pinned` is refused. Before step 1,
        on every rank (a collective unless the mode is off)."""
        if self.async_mode != "off":
            from maester.train.checkpoint_memory import fit_async_mode, node_host_memory, staged_bytes

            self.async_mode = fit_async_mode(setting, self.async_mode,
                                             node_host_memory(staged_bytes(model, optimizer)))

    def poll(self) -> None:
        """Collect the background save into `finished` if it has ended; never waits."""
        if self._in_flight is not None and self._in_flight[1].done():
            self._collect()

    def wait(self) -> None:
        """Wait for the background save, if one is in flight, and collect it into `finished`."""
        if self._in_flight is not None:
            if not self._in_flight[1].done():
                log.info("waiting for the background write of %s", self._in_flight[0].path.name)
            self._collect()

    def collect(self, wait: bool = False) -> list[SaveResult]:
        """The saves that ended (`poll`; `wait`: the one in flight too), taken out of `finished`."""
        self.wait() if wait else self.poll()
        done, self.finished = self.finished, []
        return done

    def close(self) -> None:
        """Wait for the background save, then release the thread and the staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _collect(self) -> None:
        result, future = self._in_flight
        try:
            future.result()
        finally:
            self._in_flight = None
        self.finished.append(result)

    def _submit(self, result: SaveResult, write, *args) -> None:
        """Run `write(*args)` in the saves' thread, as the save in flight (`result` its record)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maester-checkpoint")
        self._in_flight = (result, self._executor.submit(write, *args))

    def _stage(self, state: dict) -> dict:
        """A copy of `state` in host memory that training can no longer change (DCP's DefaultStager), in buffers
        made at the first save and refilled at each later one (a save waits for the previous write first): a fresh
        buffer costs a page fault per page, several times the copy (benchmarks/checkpoint_io.py). `pinned`:
        page-locked buffers, filled by non-blocking copies from the GPU, then one synchronize."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            pinned = self.async_mode == "pinned"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=pinned))
        return self._stager.stage(state)


@contextmanager
def without_zip_crc32():
    """DCP writes each tensor with torch.save, whose zip records each carry a CRC-32 computed on one core as the
    file is written: on a busy CPU at about half a disk's speed (benchmarks/checkpoint_io.py). The manifest holds a
    CRC-32 of every whole file already, and torch.load does not check the records' (torch's own note on
    `set_crc32_options`). Process-wide while it lasts: other torch.save calls meanwhile also skip it."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)
