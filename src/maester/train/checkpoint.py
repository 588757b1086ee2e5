"""Atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of `jobs/<name>/checkpoints/`:

    step-<N>/            a complete checkpoint: DCP files (.metadata, *.distcp) for model and optimizer,
                         trainer_state.json (step, schedule start, data position, tokens seen, and
                         `init_from`/`load_mode` where the run began from another checkpoint),
                         rng/rank<R>.pt, config.json, and manifest.json (every other file's size and XXH3-128,
                         taken as it is written: `checkpoint_digests.py`)
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
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from maester.config import LOAD_MODES, PARTIAL_LOAD_MODES, CheckpointConfig
from maester.files import fsync_dir, point_link, write_durably
from maester.train.checkpoint_async import BackgroundSaves, Phases, SaveResult, without_zip_crc32
from maester.train.checkpoint_digests import DIGEST, MANIFEST_FORMAT, HashingWriter, digest_of_bytes
from maester.train.checkpoint_files import (
    DAMAGED, MANIFEST, STEP_DIR, TRAINER_STATE, capture_rng_state, has_optimizer_state, is_complete, match_model,
    read_manifest, read_rng_state, read_trainer_state, restore_rng_state, step_dirs, verify_checkpoint,
)
from maester.train.checkpoint_pin import unless_pinned
from maester.train.checkpoint_reader import DamagedCheckpoint, check_metadata, dcp_load, load_model_weights
from maester.train.checkpoint_tensors import plain_state, state_to_save
from maester.train.faults import maybe_crash, maybe_hang

log = logging.getLogger("maester")

WRITE_THREADS = 1
"""Files each rank writes at once (DCP's `thread_count`): see docs/checkpoints.md for the measurement."""













def resolve_checkpoint(path: str | Path, level: str = "size") -> Path:
    """A checkpoint directory from a checkpoint path, a `checkpoints/` directory or a job directory (its newest
    `step-<N>` that passes its manifest check at `level`; damaged ones are skipped with a warning, not moved). A
    checkpoint named directly is refused when it fails the check."""
    path = Path(path)
    if path.is_dir() and (path / ".metadata").is_file():
        real = path.resolve()
        if not is_complete(real):
            raise ValueError(f"checkpoint {path} is incomplete (no {TRAINER_STATE} or .metadata)")
        problems = verify_everywhere(real, level)
        if problems:
            raise ValueError(f"checkpoint {path} fails its manifest check ({level}): {'; '.join(problems)}")
        return real
    for directory in (path, path / "checkpoints"):
        steps = step_dirs(directory)
        for step in steps:
            problems = verify_everywhere(step, level)
            if not problems:
                return step.resolve()
            log.warning("skipping the damaged checkpoint %s: %s", step, "; ".join(problems))
        if steps:
            raise ValueError(f"no intact checkpoint in {directory}: {', '.join(p.name for p in steps)} fail their "
                             f"manifest check (`maester checkpoint verify {directory}` lists why)")
    raise FileNotFoundError(f"no checkpoint at {path} (looked for a DCP checkpoint, and for step-N directories in it "
                            f"and in its checkpoints/)")


def verify_everywhere(path: Path, level: str) -> list[str]:
    """`verify_checkpoint` of `path` with every process of the job reading its share of the files (a collective
    where a process group exists: a full check of a large checkpoint reads it once over all ranks, not once on rank
    0); every rank gets all the problems found."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return verify_checkpoint(path, level)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, verify_checkpoint(path, level, share=(rank, world)))
    return [problem for part in gathered for problem in part]


class Checkpointer(BackgroundSaves):
    """Saves, finds and loads the checkpoints of a job. `async_mode` (`checkpoint.async_mode` resolved by
    `resolve_async_mode`) says how `save(background=True)` writes; `group`, the process group of the writes'
    collectives (None: the default group; `background_group` makes one for background writes)."""

    def __init__(self, job_dir: Path, cfg: CheckpointConfig, rank: int = 0, async_mode: str = "off", group=None):
        self.dir = Path(job_dir) / "checkpoints"
        self.cfg, self.rank = cfg, rank
        super().__init__(async_mode)
        self.group = group
        self.hold_retention = False
        """Saves delete no older checkpoint while set (the first steps after a load, until they prove the model)."""
        self.damaged: list[dict] = []
        """The checkpoints a resume found damaged and moved aside ({checkpoint, moved_to, problems})."""

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
        """The checkpoint to resume from, the same on every rank (a collective): the newest `step-<N>` that passes
        its manifest check of sizes (`resume` loads it, checking the checksums in the same pass; a seed checkpoint is
        checked at `checkpoint.verify` here), every rank checking its share of the files. Rank 0
        lists the candidates (ranks that each looked could disagree right after a requeue, where a shared filesystem
        caches per node), moves damaged ones aside to `step-<N>.damaged` and repoints `latest`; the damaged ones
        come back as records ({checkpoint, moved_to, problems}) for the metrics."""
        candidates = self._broadcast_from_rank_zero(self._candidates)
        damaged = self.damaged
        for name in candidates:
            path = self.dir / name
            problems = verify_everywhere(path, self._level_before_loading(path))
            if not problems:
                self._broadcast_from_rank_zero(lambda: self._point_latest_if_elsewhere(path))
                return path, damaged
            aside = self._broadcast_from_rank_zero(lambda: self._move_aside(path).name)
            log.error("CHECKPOINT DAMAGED: %s fails its manifest check (%s); moved aside to %s", path,
                      "; ".join(problems), aside)
            damaged.append({"checkpoint": name, "moved_to": aside, "problems": problems})
        self._broadcast_from_rank_zero(lambda: self._no_intact_checkpoint(damaged))
        return None, damaged

    def _level_before_loading(self, path: Path) -> str:
        """The check of `resume_point`: sizes only where `resume` checks the checksums in the loading pass (a
        `continue` load; a seed checkpoint's model-only load is checked before)."""
        try:
            seed = read_trainer_state(path).get("seed_checkpoint")
        except (ValueError, OSError):
            seed = False  # the size check reports it
        return self.cfg.verify if seed else "size"

    def _broadcast_from_rank_zero(self, work):
        """`work()` run on rank 0, its value (or its ValueError or OSError, raised as a ValueError) on every rank."""
        import torch.distributed as dist

        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", work())
            except (ValueError, OSError) as e:
                box[0] = ("error", str(e))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise ValueError(value)
        return value

    def _candidates(self) -> list[str]:
        """The `step-<N>` names to try, newest first, after the checks that fail a resume at once."""
        link = self.dir / "latest"
        if link.is_dir() and not link.is_symlink():
            raise ValueError(f"{link} is a directory, not a link (a copy made with cp -a, cp -L or rsync -L): the "
                             f"step-N directories beside it are the checkpoints. Remove it, or rename it to the "
                             f"step-N its {TRAINER_STATE} names if that checkpoint is not beside it")
        self._check_writable()
        return [p.name for p in step_dirs(self.dir)]

    def _point_latest_if_elsewhere(self, path: Path) -> None:
        link = self.dir / "latest"
        if not (link.is_symlink() and os.readlink(link) == path.name):
            log.warning("%s %s; resuming from the newest intact checkpoint %s and pointing the link at it",
                        link, f"points to {os.readlink(link)}" if link.is_symlink() else "is missing", path.name)
            self._point_latest_to(path)

    def _no_intact_checkpoint(self, damaged: list[dict]) -> None:
        """Raise when the job has checkpoints but none intact (or a `latest` pointing at nothing)."""
        link = self.dir / "latest"
        found = sorted(p.name for p in self.dir.glob(f"step-*{DAMAGED}*")) if self.dir.is_dir() else []
        if found:
            details = "".join(f"\n  {d['checkpoint']} (moved to {d['moved_to']}): {'; '.join(d['problems'])}"
                              for d in damaged)
            raise ValueError(f"no intact checkpoint in {self.dir}; found only damaged ones: {', '.join(found)}"
                             f"{details}\nTo start this job from step 0, move {self.dir} aside")
        if link.is_symlink():
            raise ValueError(f"{link} points to a missing checkpoint ({os.readlink(link)}) and no step-N directory "
                             f"is beside it")

    def set_aside_after(self, loaded: Path) -> list[str]:
        """Move aside (`step-<N>.damaged`) the checkpoints saved after checkpoint `loaded` was loaded, whose model
        turned out not to train, and point `latest` back at it; returns the names moved (rank 0 moves, every rank
        returns them); a save in flight ends first."""
        self.wait()

        def work() -> list[str]:
            step = read_trainer_state(loaded)["step"]
            moved = [self._move_aside(p).name for p in step_dirs(self.dir)
                     if int(STEP_DIR.match(p.name)[1]) > step]
            if moved and loaded.parent == self.dir:
                self._point_latest_to(loaded)
            return moved

        return self._broadcast_from_rank_zero(work)

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
        state = state_to_save(model, optimizer)  # refuses what a checkpoint cannot hold, before any file changes
        if self.rank == 0:
            self._remove_unfinished()
            self.dir.mkdir(parents=True, exist_ok=True)
        _barrier(self.group)
        files = self._small_files(step, trainer_state, config_json)
        result = SaveResult(step, final, background)
        if not background:
            self._write(step, state, files, result)
            result.blocked_seconds = time.perf_counter() - started
            self.finished.append(result)
            return final
        staged = self._stage(state)
        del state
        result.blocked_seconds = time.perf_counter() - started
        self._submit(result, self._write_in_background, step, staged, files, result)
        return final

    def _small_files(self, step: int, trainer_state: dict, config_json: str) -> dict[str, bytes | str]:
        """The files beside DCP's, by name, taken when the save starts: this rank's RNG state, and on rank 0 the
        config and the trainer state."""
        rng = io.BytesIO()  # written with open(): a full disk is an OSError, not torch's zip writer's error
        torch.save(capture_rng_state(), rng)
        files: dict[str, bytes | str] = {f"rng/rank{self.rank}.pt": rng.getvalue()}
        if self.rank == 0:
            files["config.json"] = config_json
            # its format says that the checkpoint has a manifest: a missing one is damage, not an older checkpoint
            files[TRAINER_STATE] = json.dumps({"step": step, "checkpoint_format": MANIFEST_FORMAT, **trainer_state},
                                              indent=2)
        return files

    def _write(self, step: int, state: dict, files: dict[str, bytes | str], result: SaveResult) -> None:
        """Write `state` and `files` as `step-<N>.tmp`, rename it `step-<N>` and move `latest` (every rank; in the
        save's thread for a background save). Its times go into `result`; a failure raises ValueError."""
        final = self.dir / f"step-{step}"
        tmp = self.dir / f"step-{step}.tmp"
        clock = Phases(result)
        writer = HashingWriter(tmp, WRITE_THREADS)
        try:
            with without_zip_crc32():
                # a rank's failure is raised on every rank
                dcp.save(state, storage_writer=writer, process_group=self.group)
        except (OSError, RuntimeError, CheckpointException) as e:
            raise self._not_written(final, tmp, e) from e
        clock.lap("dcp")
        maybe_crash("during_save", step)
        maybe_hang(step, "slow_write")
        listing, local_error = writer.files, None
        try:
            (tmp / "rng").mkdir(exist_ok=True)
            for name, data in files.items():
                data = data.encode() if isinstance(data, str) else data
                write_durably(tmp / name, data)
                listing[name] = {"size": len(data), DIGEST: digest_of_bytes(data)}
        except OSError as e:
            local_error = e
        clock.lap("small_files")
        listing, exists, error = self._gather_listings(listing, final, local_error)
        if error is not None:
            raise self._not_written(final, tmp, error)
        if exists:
            raise ValueError(f"{final} already exists: a run never overwrites a checkpoint (is another run using "
                             f"{self.dir.parent}?)")
        if self.rank == 0:
            try:
                for directory in (tmp / "rng", tmp):  # every file's entry on disk before the manifest names it
                    fsync_dir(directory)
                maybe_crash("before_manifest", step)
                write_durably(tmp / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "step": step, "digest": DIGEST,
                                                          "files": dict(sorted(listing.items()))}, indent=1))
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
            if not self.hold_retention:
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

    def _gather_listings(self, listing: dict[str, dict], final: Path, error: OSError | None) -> tuple[
            dict[str, dict], bool, str | None]:
        """Every rank's files with their sizes and digests (`listing` is this rank's, taken as they were written);
        whether `final` exists (rank 0's view); and the first rank's write error (`error` is this rank's), on every
        rank. A collective: after it, every rank's files are on disk."""
        import torch.distributed as dist

        reason = None if error is None else _reason(error)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return listing, final.exists(), reason
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (listing, self.rank == 0 and final.exists(), reason), group=self.group)
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
                if doomed.is_symlink():  # a checkpoint kept elsewhere and linked in: the link goes, never its target
                    target = os.readlink(doomed)
                    doomed.unlink()
                    log.info("retention: removed the link %s; its target %s is left as it is", doomed, target)
                    continue
                trash = self.dir / f"step-{s}.deleting.tmp"
                with unless_pinned(doomed) as free:
                    if not free:
                        log.info("retention: keeping %s while a reader (maester eval, generate, chat) holds it; a "
                                 "later save removes it", doomed)
                        continue
                    os.replace(doomed, trash)  # no half-deleted directory ever carries a step-<N> name
                shutil.rmtree(trash)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mode: str = "continue",
             family: str | None = None, verify: bool = False) -> dict:
        """Restore the parts of checkpoint `path` that load mode `mode` takes (`LOAD_MODES`) into `model` and
        `optimizer`, resharded to their current layout; returns the trainer state (step, data position, ...) for
        the caller to take the rest from. `continue` also restores this rank's RNG state. `verify`: check every
        file's checksum against the manifest in the same pass (`OnePassReader`): a difference raises
        `DamagedCheckpoint` after the model and optimizer were written.

        The optimizer keeps the config's hyperparameters (betas, weight decay, ...); only its state (moments,
        step counts) is taken. A part the mode needs but the checkpoint lacks is an error, and so is a checkpoint of
        another architecture than `family` (the run's `model.name`) or with other weights, unless the mode is
        partial (`PARTIAL_LOAD_MODES`, `match_model`).
        """
        parts = LOAD_MODES[mode]
        partial = mode in PARTIAL_LOAD_MODES
        expected = None
        if verify and (path / MANIFEST).is_file():
            expected = {name: (size, kind, checksum) for name, size, kind, checksum in read_manifest(path)}
            check_metadata(path, expected)  # before anything is read from it
        trainer_state = read_trainer_state(path)
        if "optimizer" in parts and not has_optimizer_state(path):
            raise ValueError(f"load mode {mode!r} takes the optimizer state, but checkpoint {path} has none (a seed "
                             f"or converted checkpoint); take the model only (load_mode 'model_only' or "
                             f"'model_data')")
        if "data" in parts and "data" not in trainer_state:
            raise ValueError(f"load mode {mode!r} takes the data position, but checkpoint {path} has none (a seed "
                             f"or converted checkpoint); use a mode that starts the data fresh")
        if "optimizer" not in parts:
            load_model_weights(path, model, family, partial, expected)
            return trainer_state
        model_sd, optim_sd = get_state_dict(model, optimizer)  # built once: the load writes into them
        match_model(path, model, family, state=model_sd)
        hyperparameters = copy.deepcopy(optim_sd["param_groups"])
        # The per-parameter state only, keyed by parameter name: the groups may differ where the checkpoint was
        # saved (a pipeline rank's groups hold its stages' parameters).
        # read into the live tensors' storage (plain_state unwraps without a copy)
        state = plain_state({"model": model_sd, "optimizer": {"state": optim_sd["state"]}})
        dcp_load(state, path, expected)
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

    def resume(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               family: str | None) -> tuple[Path, dict]:
        """Load `resume_point`'s checkpoint `path` (`continue`), checking its files' checksums in the same pass under
        `checkpoint.verify = "full"`; one found damaged then is moved aside like those `resume_point` finds (its
        record appended to the list `resume_point` returned) and the next older intact one is loaded instead, over
        every value the damaged one wrote. Returns the checkpoint loaded and its trainer state."""
        damaged = self.damaged
        while True:
            try:
                return path, self.load(path, model, optimizer, "continue", family, self.cfg.verify == "full")
            except DamagedCheckpoint as e:
                aside = self._broadcast_from_rank_zero(lambda: self._move_aside(path).name)
                log.error("CHECKPOINT DAMAGED: %s fails its manifest check (%s); moved aside to %s", path,
                          "; ".join(e.problems), aside)
                damaged.append({"checkpoint": path.name, "moved_to": aside, "problems": e.problems})
            path, _ = self.resume_point()  # its records go into `damaged` too
            if path is None or read_trainer_state(path).get("seed_checkpoint"):
                raise ValueError(f"the checkpoints of {self.dir} after {path.name if path else 'none'} were damaged "
                                 f"and moved aside; run again to start from {path.name if path else 'step 0'}")


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




