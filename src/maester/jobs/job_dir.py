"""The job directory: `jobs/<name>/{config.json, slurm.sh, logs/, checkpoints/}`, everything a run needs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from maester.config import Config, load_config
from maester.jobs.slurm import render_slurm_script

log = logging.getLogger("maester")

CONFIG_FILE = "config.json"


def is_job_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


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
    _write_atomically(job_dir / CONFIG_FILE, cfg.to_json())
    _write_atomically(job_dir / "slurm.sh", render_slurm_script(cfg, job_dir))
    os.chmod(job_dir / "slurm.sh", 0o755)
    return job_dir


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
