"""Test helpers: a small real Parquet corpus, the overrides of a tiny fast run, running the CLI, the ops that
would wait for a GPU."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.toml"

WORDS = ("the model reads a token and predicts the next one while the optimizer updates every weight "
         "of the network after each step so that the loss goes down over time").split()


def write_corpus(path: Path, n_docs: int = 200, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "." for _ in range(n_docs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs}), path)
    return path


def tiny_overrides(corpus: Path, dump_dir: Path, name: str = "tiny", **extra) -> list[str]:
    """A run of the tiny Llama on the corpus that takes a fraction of a second per step on a CPU."""
    values = {
        "job.name": name, "job.dump_dir": str(dump_dir), "model.flavor": "tiny",
        "data.sources": f'[{{"path":"{corpus}"}}]', "data.seq_len": "32",
        "training.steps": "8", "training.global_batch_size": "4", "training.micro_batch_size": "2",
        "training.device": "cpu", "optimizer.lr": "3e-3", "schedule.name": "cosine",
        "schedule.warmup_steps": "2", "checkpoint.interval": "4", "logging.interval": "1",
    }
    values.update({k.replace("__", "."): str(v) for k, v in extra.items()})
    return [f"--{k}={v}" for k, v in values.items()]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAESTER_", "_MAESTER_FAULT", "_MAESTER_HANG"))}
    env.update(extra)
    return env


def run_maester(args: list[str], cwd: Path, env: dict[str, str] | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m maester ARGS`: a fresh process, forked from one that imported torch and maester (`tests.forks`)."""
    from tests import forks

    env = env or clean_env()
    forked = forks.run(args, cwd, env, timeout)
    if forked is not None:
        return forked
    return subprocess.run([sys.executable, "-m", "maester", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def start_maester(args: list[str], cwd: Path, env: dict[str, str] | None = None):
    """`python -m maester ARGS` started, not waited for, in a process group of its own (`tests.forks.Forked`:
    poll, wait, communicate, send_signal to the group, kill, output so far)."""
    from tests import forks

    return forks.start_or_real(args, cwd, env or clean_env())


def run_python(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300,
               script: Path | None = None, module: str | None = None) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` (or `python -m MODULE ARGS`): a fresh process, forked from one that imported torch and
    maester (`tests.forks`), or where it must be, a real one."""
    from tests import forks

    env = env or clean_env()
    cwd = cwd or REPO
    forked = forks.run_python(args, cwd, env, timeout, script, module)
    if forked is not None:
        return forked
    target = ["-m", module] if script is None else [str(script)]
    return subprocess.run([sys.executable, *target, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def run_code(code: str, args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS`: `run_python` of CODE written to a file of its own (its folder first on sys.path, not
    the working directory: CODE imports installed packages only)."""
    with tempfile.TemporaryDirectory(prefix="maester-code-") as folder:
        script = Path(folder) / "code.py"
        script.write_text(code)
        return run_python(args, cwd, env, timeout, script=script)


def torchrun(nproc: int, args: list[str], cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 300, agent: bool = False, script: Path | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N -m maester ARGS` (or `SCRIPT ARGS`) on this machine (gloo on
    CPU): its ranks forked from one process that imported torch and maester (`tests.forks`), or with `agent` real
    torchrun, for tests of what its agent does."""
    from tests import forks

    env = env or clean_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    forked = None if agent else forks.torchrun(nproc, args, cwd, env, timeout, script)
    if forked is not None:
        return forked
    target = ["-m", "maester"] if script is None else [str(script)]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", *target, *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def seed_job(corpus: Path, dump_dir: Path, name: str, **extra) -> Path:
    """A job of the tiny model (`tiny_overrides` and `extra`) with its randomly initialised weights saved as the
    step-0 checkpoint: varied greedy outputs, without training."""
    from maester.config import load_config
    from maester.train.trainer import write_seed_checkpoint

    cfg = load_config(None, tiny_overrides(corpus, dump_dir, name, **extra), environ={})
    write_seed_checkpoint(cfg, cfg.job_dir)
    return cfg.job_dir


def train_reference(root: Path, corpus: Path, name: str = "reference", **extra) -> tuple[Path, Path]:
    """One process trains the tiny job `name` from a seed checkpoint, which is also copied aside for other jobs to
    start from; returns (the copy, the job directory)."""
    from maester.config import load_config
    from maester.train.trainer import Trainer, write_seed_checkpoint

    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", name, **extra), environ={})
    write_seed_checkpoint(cfg, cfg.job_dir)
    seed = root / "seed-checkpoints"
    shutil.copytree(cfg.job_dir / "checkpoints", seed, symlinks=True)
    Trainer(cfg, cfg.job_dir).train()
    return seed, cfg.job_dir


def train_seeded_reference(root: Path, **extra) -> tuple[Path, Path, Path]:
    """`train_reference` on a new corpus under `root`; returns (corpus, seed checkpoints, job directory)."""
    corpus = write_corpus(root / "data" / "corpus.parquet")
    return corpus, *train_reference(root, corpus, **extra)


def job_from_checkpoints(root: Path, corpus: Path, checkpoints: Path | None, name: str, **extra) -> Path:
    """A tiny job made by `maester submit --no-submit` whose checkpoints are a copy of `checkpoints` (None: the
    job's own, none yet)."""
    overrides = tiny_overrides(corpus, root / "jobs", name, **extra)
    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG), *overrides], root)
    assert out.returncode == 0, out.stderr
    job = root / "jobs" / name
    if checkpoints is not None:
        shutil.rmtree(job / "checkpoints")
        shutil.copytree(checkpoints, job / "checkpoints", symlinks=True)
    return job


def rewrite_manifest(checkpoint: Path) -> None:
    """Make a checkpoint's manifest.json list its files' current sizes and checksums, as someone who edits a
    checkpoint can: what is tested behind it is then reached past the manifest check."""
    import json

    from maester.train.checkpoint_digests import MANIFEST_FORMAT
    from maester.train.checkpoint_files import MANIFEST, describe_files

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    names = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*")
                   if p.is_file() and p.name != MANIFEST)
    manifest["files"] = describe_files(checkpoint, names)
    manifest["format"] = MANIFEST_FORMAT  # the entries are XXH3-128s, whatever the manifest held before
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=1))


# Ops whose CUDA kernels read a device value back to the host (the GPU queue drains): bincount reads the max,
# nonzero and masked_select the count, repeat_interleave without output_size the total.
DEVICE_READS = {"aten.bincount.default", "aten.nonzero.default", "aten.masked_select.default",
                "aten._local_scalar_dense.default", "aten.unique_dim.default", "aten._unique2.default"}


def reads_device_value(func, kwargs: dict) -> bool:
    """Whether the op `func` (an OpOverload) with `kwargs` reads a device value back on CUDA."""
    return str(func) in DEVICE_READS or (str(func) == "aten.repeat_interleave.Tensor"
                                         and kwargs.get("output_size") is None)


def DeviceReads():
    """A dispatch mode that lists in `.calls` the ops run under it that read a device value back on CUDA
    (`DEVICE_READS`); on the CPU they show which a GPU run would call. Host reads that are not ops (`tolist`)
    are not seen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if reads_device_value(func, kwargs):
                self.calls.append(str(func))
            return func(*args, **kwargs)

    return Mode()
