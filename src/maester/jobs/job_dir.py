"""The job directory: `jobs/<name>/{config.json, slurm.sh, logs/, checkpoints/}`, everything a run needs (and
`after.sh`, the post-processing job, when `slurm.after` has commands)."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from maester.config import Config, load_config
from maester.config_sources import NO_JOB_LOCK
from maester.files import write_atomically
from maester.jobs.slurm import AFTER_SCRIPT, render_after_script, render_slurm_script

log = logging.getLogger("maester")

CONFIG_FILE = "config.json"


def is_job_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def refuse_checkpoint(target: str | Path, command: str) -> None:
    """A checkpoint holds a config.json too, but a command on a job must not take one for a job (`train` would
    start a new run inside it): refuse it, naming its job."""
    path = Path(target)
    if not ((path / ".metadata").is_file() and (path / "trainer_state.json").is_file()):
        return
    real = path.resolve()
    job = real.parent.parent if real.parent.name == "checkpoints" and is_job_dir(real.parent.parent) else None
    raise ValueError(f"{path} is a checkpoint" + (f" of the job {job}, not a job directory: `maester {command} {job}` "
                                                    f"acts on the job" if job else ", not a job directory"))


def write_job_dir(cfg: Config, job_dir: Path | None = None) -> Path:
    """Create or update the job directory; config.json is replaced atomically (and what changed is logged)."""
    job_dir = Path(job_dir or cfg.job_dir)
    if is_job_dir(job_dir):
        saved = Config.from_json_file(job_dir / CONFIG_FILE)
        if cfg != saved:
            changed = sorted(_diff(saved.model_dump(mode="json"), cfg.model_dump(mode="json")))
            log.info("updating %s: %s", job_dir / CONFIG_FILE, ", ".join(changed))
    for sub in ("logs", "checkpoints"):
        (job_dir / sub).mkdir(parents=True, exist_ok=True)
    write_atomically(job_dir / CONFIG_FILE, cfg.to_json())
    workdir = _workdir_of(job_dir / "slurm.sh")
    write_atomically(job_dir / "slurm.sh", render_slurm_script(cfg, job_dir, workdir))
    os.chmod(job_dir / "slurm.sh", 0o755)
    if cfg.slurm.after:
        write_atomically(job_dir / AFTER_SCRIPT, render_after_script(cfg, job_dir, workdir))
        os.chmod(job_dir / AFTER_SCRIPT, 0o755)
    else:
        (job_dir / AFTER_SCRIPT).unlink(missing_ok=True)
    return job_dir


def config_changes(cfg: Config, job_dir: Path, update: bool) -> list[str]:
    """What `cfg` changes in the config.json of the existing job `job_dir` (nothing for a new job), for `maester
    submit`: refused unless `update` (--update-config), and a change of the model refused even then where the job
    has a checkpoint, which it could not resume from. Where the job directory lies (`job.dump_dir`) is no change."""
    from maester.train.checkpoint_dirs import newest_complete

    if not is_job_dir(job_dir):
        return []
    saved, new = Config.from_json_file(job_dir / CONFIG_FILE).model_dump(mode="json"), cfg.model_dump(mode="json")
    for values in (saved, new):
        values["job"].pop("dump_dir", None)
    changed = sorted(_diff(saved, new))
    checkpoint = newest_complete(job_dir / "checkpoints")
    model = [change for change in changed if change.startswith("model.")]
    if model and checkpoint is not None:
        raise ValueError(f"{job_dir} has a checkpoint ({checkpoint.name}) of the model in its config.json, and this "
                         f"config changes the model ({', '.join(model)}): the job could not resume. Give this "
                         f"config a job of its own (another name)")
    if changed and not update:
        raise ValueError(f"{job_dir} exists, and this config changes its config.json ({', '.join(changed)}): give "
                         f"it another name for a new job, or pass --update-config to go on with these values")
    return changed


def _workdir_of(script: Path) -> Path | None:
    """The directory an existing job script changes to (where the job was created from): a run started from
    elsewhere keeps it. None for a new job (the current directory)."""
    import shlex

    if not script.is_file():
        return None
    for line in script.read_text().splitlines():
        if line.startswith("cd "):
            words = shlex.split(line)
            if len(words) == 2:
                return Path(words[1])
    return None


def config_for_target(target: str, overrides: list[str]) -> tuple[Config, Path]:
    """`target` is a job directory (its config.json, plus overrides) or a config file (the job dir is derived)."""
    if is_job_dir(target):
        return load_config(Path(target) / CONFIG_FILE, overrides), Path(target)
    if Path(target).is_dir():
        raise FileNotFoundError(f"{target} is a directory without {CONFIG_FILE}: not a job directory")
    cfg = load_config(target, overrides)
    return cfg, cfg.job_dir


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}={b!r}"]


LOCK_FILE = "run.lock"


class JobLocked(ValueError):
    """Another run holds the job directory's lock."""


class JobLock:
    """One run per job directory: a POSIX record lock (`fcntl.lockf`) on `<job>/run.lock`, held by rank 0 for the
    life of the run and released by the kernel when the process ends, however it ends. The file holds who has it
    (host, pid, SLURM job id, since when) for the message a second run prints.

    Across nodes this needs a filesystem whose fcntl locks are cluster-wide: NFS (v3 with lockd, v4), Lustre
    mounted with `flock` (not `localflock`, which locks per node only), GPFS. Where locks are not supported at all
    the run refuses to start and says so; `MAESTER_NO_JOB_LOCK=1` runs without the guard."""

    def __init__(self, job_dir: Path):
        self.path = Path(job_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, wait_seconds: float = 0.0) -> None:
        import errno
        import fcntl
        import json
        import socket
        import time

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            what = "is a directory, not the lock file" if isinstance(e, IsADirectoryError) else \
                f"cannot be opened for writing ({e.strerror})"
            raise ValueError(f"{self.path} {what}: a run needs a job directory it can write (its lock, "
                             f"checkpoints, logs and metrics)") from None
        deadline, waited = time.monotonic() + wait_seconds, False
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(fd)
                    raise ValueError(f"{self.path}: cannot lock it ({e.strerror}): this filesystem does not support "
                                     f"file locks (on Lustre, mount with -o flock). Set MAESTER_NO_JOB_LOCK=1 to run "
                                     f"without the one-run-per-job guard") from None
                if time.monotonic() >= deadline:
                    holder = self._holder(fd)
                    os.close(fd)
                    raise JobLocked(f"{self.path.parent} is in use by another run ({holder})"
                                    + (f"; waited {wait_seconds:.0f} s for it" if wait_seconds else "")
                                    + f": one run per job directory. Wait for it to end or stop it; {self.path} "
                                      f"is released when that process exits") from None
                if not waited:
                    log.info("waiting up to %.0f s for the previous run of %s to end (%s)", wait_seconds,
                             self.path.parent, self._holder(fd))
                    waited = True
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self.fd = fd

    @staticmethod
    def _holder(fd: int) -> str:
        """Who holds the lock, read through the same descriptor: closing any other descriptor of the file would
        drop this process's own POSIX locks on it."""
        import json

        try:
            h = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, UnicodeDecodeError):
            return "holder unknown"
        if not isinstance(h, dict):
            return "holder unknown"
        return (f"host {h.get('host')}, pid {h.get('pid')}"
                + (f", SLURM job {h['slurm_job_id']}" if h.get("slurm_job_id") else "")
                + f", since {h.get('since')}")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextmanager
def locked_for_writing(job_dir: Path, command: str):
    """Hold an existing job directory's lock while `command` (not training, which holds it itself) rewrites it: a
    running job's config.json must not change under it, or its next resume trains with the new values. A job that
    another process holds is refused before anything is written."""
    if not is_job_dir(job_dir):
        yield
        return
    try:
        lock = lock_job_dir(job_dir, 0.0)
    except JobLocked as e:
        raise JobLocked(f"maester {command} would rewrite the config of a running job, and does not: {e}") from None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def lock_job_dir(job_dir: Path, requeue_wait_seconds: float) -> JobLock | None:
    """Take the job directory's lock for this run; a requeued SLURM job waits for its predecessor's."""
    if os.environ.get(NO_JOB_LOCK) == "1":
        log.warning("%s=1: %s is not locked; two runs of it would overwrite each other", NO_JOB_LOCK, job_dir)
        return None
    requeued = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    lock = JobLock(job_dir)
    lock.acquire(requeue_wait_seconds if requeued else 0.0)
    return lock
