"""Atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of `jobs/<name>/checkpoints/`:

    step-<N>/            a complete checkpoint: DCP files (.metadata, *.distcp) for model and optimizer,
                         trainer_state.json (step, schedule start, data position, tokens seen, and
                         `init_from`/`load_mode` where the run began from another checkpoint),
                         rng/rank<R>.pt, config.json, and manifest.json (every other file's size and CRC-32)
    latest -> step-<N>   a convenience link, moved (atomically) after step-<N> is complete
    step-<N>.tmp/        a save in progress; never loaded, removed by the next save
    step-<N>.damaged/    a checkpoint that failed its manifest check at resume, moved aside (never deleted)

A checkpoint is written under the temporary name, its manifest last, and renamed when every file is on disk, so a
crash at any moment leaves the previous checkpoint whole and loadable. A run resumes from the newest `step-<N>`
that matches its manifest, whatever `latest` says (copies made with `rsync -r` drop the link).
Checkpoint files are read without unpickling anything but DCP's own metadata classes (`checkpoint_files.py`).

A job resumes from its own latest checkpoint with everything in it; a new run can take named parts of
another checkpoint (`checkpoint.load_mode`, the table `LOAD_MODES`), or the weights of a Hugging Face model
directory (`checkpoint.init_from = "hf:PATH"`, `load_hf_weights`).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from maester.config import LOAD_MODES, CheckpointConfig
from maester.files import fsync_dir, point_link, write_durably
from maester.train.checkpoint_files import (
    DAMAGED, MANIFEST, STEP_DIR, TRAINER_STATE, capture_rng_state, dcp_load, describe_files,
    has_optimizer_state, is_complete, load_model_weights, read_rng_state, read_trainer_state, restore_rng_state,
    single_process_ok, step_dirs, verify_checkpoint,
)
from maester.train.faults import maybe_crash, maybe_hang

log = logging.getLogger("maester")














def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path, a `checkpoints/` directory or a job directory (its newest
    `step-<N>` that matches its manifest's sizes; damaged ones are skipped with a warning, not moved)."""
    path = Path(path)
    if path.is_dir() and (path / ".metadata").is_file():
        real = path.resolve()
        if not is_complete(real):
            raise ValueError(f"checkpoint {path} is incomplete (no {TRAINER_STATE} or .metadata)")
        return real
    for directory in (path, path / "checkpoints"):
        steps = step_dirs(directory)
        for step in steps:
            problems = verify_checkpoint(step, "size")
            if not problems:
                return step.resolve()
            log.warning("skipping the damaged checkpoint %s: %s", step, "; ".join(problems))
        if steps:
            raise ValueError(f"no intact checkpoint in {directory}: {', '.join(p.name for p in steps)} fail their "
                             f"manifest check (`maester checkpoint verify {directory}` lists why)")
    raise FileNotFoundError(f"no checkpoint at {path} (looked for a DCP checkpoint, and for step-N directories in it "
                            f"and in its checkpoints/)")


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
        """Its metrics.jsonl line: `checkpoint` (complete) or `checkpoint_failed`, at the checkpoint's step."""
        record = {"event": "checkpoint" if self.error is None else "checkpoint_failed", "step": self.step,
                  "checkpoint": self.path.name, "background": self.background,
                  "checkpoint_blocked_seconds": round(self.blocked_seconds, 4)}
        if self.write_seconds is not None:
            record["checkpoint_write_seconds"] = round(self.write_seconds, 4)
        if self.error is not None:
            record["error"] = self.error
        return record


class _Phases:
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
    is several times faster than the disk) and `off` elsewhere; `pinned` needs CUDA and is refused elsewhere."""
    if setting == "auto":
        return "async" if device_type == "cuda" else "off"
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


class Checkpointer:
    """Saves, finds and loads the checkpoints of a job. `async_mode` (`checkpoint.async_mode` resolved by
    `resolve_async_mode`) says how `save(background=True)` writes; `group`, the process group of the writes'
    collectives (None: the default group; `background_group` makes one for background writes)."""

    def __init__(self, job_dir: Path, cfg: CheckpointConfig, rank: int = 0, async_mode: str = "off", group=None):
        self.dir = Path(job_dir) / "checkpoints"
        self.cfg, self.rank = cfg, rank
        self.async_mode, self.group = async_mode, group
        self.finished: list[SaveResult] = []
        """The saves that ended, complete or failed, since the caller last emptied the list."""
        self._in_flight: tuple[SaveResult, Future] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager = None  # DCP's stager, which keeps its buffers from save to save

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

    def _write_in_background(self, step: int, state: dict, files: dict[str, bytes | str], result: SaveResult) -> None:
        """`_write` in the save's thread; its outcome is logged at once (the loop may be busy for a while) and kept
        in `result`, a failure as its `error`, not raised: training goes on and the next save tries again."""
        try:
            self._write(step, state, files, result)
        except (Exception, CheckpointException) as e:
            result.error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {_reason(e)}"
            log.error("CHECKPOINT NOT WRITTEN: the background save of %s failed: %s. Training goes on; the next save "
                      "tries again", result.path.name, result.error)
            return
        log.info("checkpoint %s written in the background in %.1f s (the loop waited %.2f s)", result.path,
                 result.write_seconds, result.blocked_seconds)

    def latest(self) -> Path | None:
        """The newest complete `step-<N>` (not verified: for reports; a resume uses `resume_point`)."""
        return next((p for p in step_dirs(self.dir) if is_complete(p)), None)

    def resume_point(self) -> tuple[Path | None, list[dict]]:
        """The checkpoint to resume from, as rank 0 finds it, on every rank (a collective): the newest `step-<N>`
        that passes its manifest check (`checkpoint.verify`). Newer damaged ones are moved aside to
        `step-<N>.damaged`; they come back as records ({checkpoint, moved_to, problems}) for the metrics. Ranks
        that each looked could disagree right after a requeue, where a shared filesystem caches per node."""
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self._find_resume_point()
        box: list = [None]
        if self.rank == 0:
            try:
                found, damaged = self._find_resume_point()
                box[0] = ("ok", None if found is None else str(found), damaged)
            except (ValueError, OSError) as e:
                box[0] = ("error", str(e), None)
        dist.broadcast_object_list(box, src=0)
        kind, value, damaged = box[0]
        if kind == "error":
            raise ValueError(value)
        return (None if value is None else Path(value)), damaged

    def _find_resume_point(self) -> tuple[Path | None, list[dict]]:
        link = self.dir / "latest"
        if link.is_dir() and not link.is_symlink():
            raise ValueError(f"{link} is a directory, not a link (a copy made with cp -a, cp -L or rsync -L): the "
                             f"step-N directories beside it are the checkpoints. Remove it, or rename it to the "
                             f"step-N its {TRAINER_STATE} names if that checkpoint is not beside it")
        self._check_writable()
        damaged = []
        for path in step_dirs(self.dir):
            problems = verify_checkpoint(path, self.cfg.verify)
            if not problems:
                if not (link.is_symlink() and os.readlink(link) == path.name):
                    log.warning("%s %s; resuming from the newest intact checkpoint %s and pointing the link at it",
                                link, f"points to {os.readlink(link)}" if link.is_symlink() else "is missing",
                                path.name)
                    self._point_latest_to(path)
                return path, damaged
            aside = self._move_aside(path)
            log.error("CHECKPOINT DAMAGED: %s fails its manifest check (%s); moved aside to %s", path,
                      "; ".join(problems), aside.name)
            damaged.append({"checkpoint": path.name, "moved_to": aside.name, "problems": problems})
        found = sorted(p.name for p in self.dir.glob(f"step-*{DAMAGED}*")) if self.dir.is_dir() else []
        if found:
            details = "".join(f"\n  {d['checkpoint']} (moved to {d['moved_to']}): {'; '.join(d['problems'])}"
                              for d in damaged)
            raise ValueError(f"no intact checkpoint in {self.dir}; found only damaged ones: {', '.join(found)}"
                             f"{details}\nTo start this job from step 0, move {self.dir} aside")
        if link.is_symlink():
            raise ValueError(f"{link} points to a missing checkpoint ({os.readlink(link)}) and no step-N directory "
                             f"is beside it")
        return None, damaged

    def _move_aside(self, path: Path) -> Path:
        aside, n = path.with_name(path.name + DAMAGED), 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}{DAMAGED}-{n}")
        os.replace(path, aside)
        fsync_dir(self.dir)
        return aside

    def _check_writable(self) -> None:
        """Fail at start, not at the first save after hours of steps."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".write-test-{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"checkpoint directory {self.dir} cannot be written: {e.strerror or e}") from None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, trainer_state: dict,
             config_json: str, background: bool = False) -> Path:
        """Write checkpoint `step` (a collective call: every rank writes its shards, then checksums its share of
        the files for the manifest), then move `latest` to it. An existing `step-<N>` is never overwritten.

        Without an optimizer only the model is written (a seed checkpoint). A save first waits for the one in
        flight. `background` (with `async_mode` async or pinned): return once the state is staged in host memory,
        and write it in a thread; `poll` and `wait` collect its outcome into `finished`, and a failure there is
        recorded, not raised. Otherwise the write happens here and a failure is raised.
        """
        started = time.perf_counter()
        self.wait()
        background = background and self.async_mode != "off"
        final = self.dir / f"step-{step}"
        if self.rank == 0:
            self._remove_unfinished()
            self.dir.mkdir(parents=True, exist_ok=True)
        _barrier(self.group)
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        files = self._small_files(step, trainer_state, config_json)
        result = SaveResult(step, final, background)
        if not background:
            self._write(step, state, files, result)
            result.blocked_seconds = time.perf_counter() - started
            self.finished.append(result)
            return final
        staged = self._stage(state)
        del state
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maester-checkpoint")
        result.blocked_seconds = time.perf_counter() - started
        self._in_flight = (result, self._executor.submit(self._write_in_background, step, staged, files, result))
        return final

    def _small_files(self, step: int, trainer_state: dict, config_json: str) -> dict[str, bytes | str]:
        """The files beside DCP's, by name, taken when the save starts: this rank's RNG state, and on rank 0 the
        config and the trainer state."""
        rng = io.BytesIO()  # written with open(): a full disk is an OSError, not torch's zip writer's error
        torch.save(capture_rng_state(), rng)
        files: dict[str, bytes | str] = {f"rng/rank{self.rank}.pt": rng.getvalue()}
        if self.rank == 0:
            files["config.json"] = config_json
            files[TRAINER_STATE] = json.dumps({"step": step, **trainer_state}, indent=2)
        return files

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

    def _write(self, step: int, state: dict, files: dict[str, bytes | str], result: SaveResult) -> None:
        """Write `state` and `files` as `step-<N>.tmp`, rename it `step-<N>` and move `latest` (every rank; in the
        save's thread for a background save). Its times go into `result`; a failure raises ValueError."""
        final = self.dir / f"step-{step}"
        tmp = self.dir / f"step-{step}.tmp"
        clock = _Phases(result)
        try:
            with single_process_ok(), _without_zip_crc32():
                # a rank's failure is raised on every rank
                dcp.save(state, checkpoint_id=tmp, process_group=self.group)
        except (OSError, RuntimeError, CheckpointException) as e:
            raise self._not_written(final, tmp, e) from e
        clock.lap("dcp")
        maybe_crash("during_save", step)
        maybe_hang(step, "slow_write")
        local_error = None
        try:
            (tmp / "rng").mkdir(exist_ok=True)
            for name, data in files.items():
                write_durably(tmp / name, data)
        except OSError as e:
            local_error = e
        _barrier(self.group)  # every rank's files are on disk before they are listed
        clock.lap("small_files")
        listing, exists, error = self._describe_shares(tmp, final, local_error)
        if error is not None:
            raise self._not_written(final, tmp, error)
        if exists:
            raise ValueError(f"{final} already exists: a run never overwrites a checkpoint (is another run using "
                             f"{self.dir.parent}?)")
        clock.lap("checksums")
        if self.rank == 0:
            try:
                maybe_crash("before_manifest", step)
                write_durably(tmp / MANIFEST, json.dumps({"step": step, "files": dict(sorted(listing.items()))},
                                                          indent=1))
                os.replace(tmp, final)
                fsync_dir(self.dir)
            except OSError as e:
                error = e
        error = _from_rank_zero(error, self.group)  # a barrier too: every rank learns whether the rename happened
        if error is not None:
            raise self._not_written(final, tmp, error)
        if self.rank == 0:
            maybe_crash("before_latest", step)
            self._point_latest_to(final)
            self._apply_retention(step)
        _barrier(self.group)
        clock.lap("rename_and_retention")
        result.write_seconds = clock.total()

    def _not_written(self, final: Path, tmp: Path, error) -> ValueError:
        """The error of a save that failed (a full disk, a quota): the previous checkpoint is untouched. Rank 0
        removes the partial files, which would otherwise hold the space until the next save."""
        if isinstance(error, BaseException):
            # torch's zip writer turns a failed write into "unexpected pos": a probe write finds the reason
            error = (_failed_write(self.dir) if isinstance(error, RuntimeError) or "unexpected pos" in str(error)
                     else None) or _reason(error)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = self.latest()
        kept = f"{previous.name} is unchanged and is where a resume starts" if previous else "there is no earlier one"
        return ValueError(f"checkpoint {final.name} could not be written in {self.dir}: {error}. Nothing of it is "
                          f"kept; {kept}. Free space (or raise the quota) and run again")

    def _describe_shares(self, tmp: Path, final: Path, error: OSError | None) -> tuple[dict[str, dict], bool,
                                                                                      str | None]:
        """Every file of `tmp` with its size and CRC-32, each rank reading its share; whether `final` exists (rank
        0's view); and the first rank's write error (`error` is this rank's), on every rank."""
        import torch.distributed as dist

        names = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        reason = None if error is None else _reason(error)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return ({} if reason else describe_files(tmp, names)), final.exists(), reason
        world = dist.get_world_size()
        mine = ({} if reason else describe_files(tmp, names[self.rank::world]), self.rank == 0 and final.exists(),
                reason)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine, group=self.group)
        files = {name: entry for part, _, _ in gathered for name, entry in part.items()}
        return files, gathered[0][1], next((r for _, _, r in gathered if r), None)

    def _point_latest_to(self, target: Path) -> None:
        point_link(self.dir / "latest", target.name)

    def _remove_unfinished(self) -> None:
        if self.dir.is_dir():
            for path in self.dir.glob("*.tmp"):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()

    def _apply_retention(self, newest: int) -> None:
        steps = sorted(int(STEP_DIR.match(p.name)[1]) for p in self.dir.iterdir() if STEP_DIR.match(p.name))
        keep = set(steps[-self.cfg.keep_last:]) | {newest}
        if self.cfg.keep_every:
            keep |= {s for s in steps if s % self.cfg.keep_every == 0}
        for s in steps:
            if s not in keep:
                doomed = self.dir / f"step-{s}"
                trash = self.dir / f"step-{s}.deleting.tmp"
                os.replace(doomed, trash)  # no half-deleted directory ever carries a step-<N> name
                shutil.rmtree(trash)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mode: str = "continue") -> dict:
        """Restore the parts of checkpoint `path` that load mode `mode` takes (`LOAD_MODES`) into `model` and
        `optimizer`, resharded to their current layout; returns the trainer state (step, data position, ...) for
        the caller to take the rest from. `continue` also restores this rank's RNG state.

        The optimizer keeps the config's hyperparameters (betas, weight decay, ...); only its state (moments,
        step counts) is taken. A part the mode needs but the checkpoint lacks is an error.
        """
        parts = LOAD_MODES[mode]
        trainer_state = read_trainer_state(path)
        if "optimizer" in parts and not has_optimizer_state(path):
            raise ValueError(f"load mode {mode!r} takes the optimizer state, but checkpoint {path} has none (a seed "
                             f"or converted checkpoint); take the model only (load_mode 'model_only' or "
                             f"'model_data')")
        if "data" in parts and "data" not in trainer_state:
            raise ValueError(f"load mode {mode!r} takes the data position, but checkpoint {path} has none (a seed "
                             f"or converted checkpoint); use a mode that starts the data fresh")
        if "optimizer" not in parts:
            load_model_weights(path, model)
            return trainer_state
        model_sd, optim_sd = get_state_dict(model, optimizer)
        hyperparameters = copy.deepcopy(optim_sd["param_groups"])
        # The per-parameter state only, keyed by parameter name: the groups may differ where the checkpoint was
        # saved (a pipeline rank's groups hold its stages' parameters).
        state = {"model": model_sd, "optimizer": {"state": optim_sd["state"]}}
        dcp_load(state, path)
        state["optimizer"]["param_groups"] = hyperparameters
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if mode != "continue":
            return trainer_state
        rng_file = path / "rng" / f"rank{self.rank}.pt"
        if rng_file.is_file():
            restore_rng_state(read_rng_state(rng_file, self.cfg.trust_pickled_rng))
        else:
            log.warning("checkpoint %s has no RNG state for rank %d (saved on fewer ranks)", path, self.rank)
        return trainer_state


















@contextmanager
def _without_zip_crc32():
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


def _reason(error: BaseException) -> str:
    """What went wrong, from an OSError or DCP's CheckpointException (which holds each failing rank's error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        failure = next(iter(error.failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _failed_write(directory: Path) -> str | None:
    """The OSError of writing 4 MiB into `directory` (a full disk, a quota, a file size limit), or None."""
    probe = directory / f".write-probe-{os.getpid()}.tmp"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(4 << 20))
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as e:
        return e.strerror or str(e)
    finally:
        probe.unlink(missing_ok=True)


def _from_rank_zero(error: BaseException | None, group=None) -> str | None:
    """Rank 0's error (or None) on every rank of `group` (None: all); a barrier too."""
    import torch.distributed as dist

    reason = None if error is None else _reason(error)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return reason
    box = [reason]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _barrier(group=None) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)




