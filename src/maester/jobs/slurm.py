"""SLURM: render `jobs/<name>/slurm.sh` from a Jinja2 template and submit it with `sbatch`.

Templates: `default` and `lumi` ship in `maester/jobs/templates/`; `slurm.template` may also name a file of your
own, which can `{% include "run.sh.j2" %}` for maester's launch-and-requeue body. Undefined variables are errors.
Every submission is recorded in `jobs/<name>/slurm_jobs.jsonl` (one JSON object a line), and so are the
restarts after failures (`slurm.max_restarts`) and the post-processing job (`slurm.after`): `maester.jobs.job_end`.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from maester.config import Config

TEMPLATES = {"default": "default.sh.j2", "lumi": "lumi.sh.j2"}
# What a preset assumes for the fields a config leaves at their defaults (LUMI-G: 8 GCDs and 56 cores a node).
CPUS_PER_GPU = 8
"""Cores per GPU when `slurm.cpus_per_task` is unset: the launcher, one rank per GPU and its loader workers."""
PRESETS = {"lumi": dict(gpus_per_node=8, cpus_per_task=56, mem="0", partition="standard-g")}
JOB_IDS_FILE = "slurm_jobs.jsonl"
AFTER_TEMPLATE = "after.sh.j2"
AFTER_SCRIPT = "after.sh"


class SubmitError(ValueError):
    pass


def _environment(search: list[Path]):
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(p) for p in search]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    return env


def _template_source(name: str) -> tuple[list[Path], str]:
    """(loader search path, template name) for `slurm.template`."""
    packaged = Path(str(resources.files("maester.jobs").joinpath("templates")))
    if name in TEMPLATES:
        return [packaged], TEMPLATES[name]
    path = Path(name)
    if not path.is_file():
        raise SubmitError(f"slurm.template {name!r} is neither {' nor '.join(map(repr, TEMPLATES))} nor a file")
    return [path.resolve().parent, packaged], path.name


def container_prefix(cfg: Config, job_dir: Path, workdir: Path) -> str:
    """`singularity exec --bind ... IMAGE ` (with a trailing space), or "" without a container."""
    c = cfg.slurm.container
    if c.runtime == "none":
        return ""
    binds = list(dict.fromkeys([str(workdir), str(job_dir), *c.binds]))
    parts = [c.runtime, "exec", *(f"--bind={b}" for b in binds), *c.options, c.image]
    return " ".join(shlex.quote(p) for p in parts) + " "


def render_slurm_script(cfg: Config, job_dir: Path, workdir: Path | None = None) -> str:
    """The job script for `cfg`, run from `workdir` (default: the current directory)."""
    return _render(cfg, job_dir, workdir)


def render_after_script(cfg: Config, job_dir: Path, workdir: Path | None = None) -> str:
    """The post-processing job's script (`slurm.after`), from the packaged `after.sh.j2` whatever the template."""
    return _render(cfg, job_dir, workdir, AFTER_TEMPLATE)


def _render(cfg: Config, job_dir: Path, workdir: Path | None, packaged: str | None = None) -> str:
    import jinja2

    job_dir, workdir = Path(job_dir).resolve(), Path(workdir or Path.cwd()).resolve()
    for what, path in (("the job directory", job_dir), ("the working directory", workdir)):
        if '"' in str(path) or any(ord(ch) < 32 or ord(ch) == 127 for ch in str(path)):
            raise SubmitError(f"{what} {str(path)!r} holds a double quote or a control character, which a job "
                              f"script cannot hold safely: use another path")
    if "\\" in str(job_dir):  # sbatch drops it from #SBATCH --output and then expands no %j: one log for all jobs
        raise SubmitError(f"the job directory {str(job_dir)!r} holds a backslash, which sbatch's #SBATCH --output "
                          f"line reads as an escape: use another path")
    s = cfg.slurm
    preset = {k: v for k, v in PRESETS.get(s.template, {}).items() if getattr(s, k) == type(s).model_fields[k].default}
    s = s.model_copy(update=preset)
    if s.cpus_per_task is None and s.gpus_per_node:  # the cluster's default is often one core per task
        s = s.model_copy(update={"cpus_per_task": CPUS_PER_GPU * s.gpus_per_node})
    search, name = _template_source(s.template)
    if packaged is not None:
        name = packaged
    python = s.python or ("python3" if s.container.runtime != "none" else sys.executable)
    context = dict(job_name=cfg.job.name, job_dir=str(job_dir), workdir=str(workdir), slurm=s,
                   nproc_per_node=s.nproc_per_node or s.gpus_per_node or 1, python=python,
                   container=container_prefix(cfg, job_dir, workdir))
    try:
        return _environment(search).get_template(name).render(**context)
    except jinja2.UndefinedError as e:
        raise SubmitError(f"slurm.template {s.template!r}: {e.message} (variables: "
                          f"{', '.join(sorted(context))})") from None
    except jinja2.TemplateError as e:
        where = f"{getattr(e, 'filename', None) or name}:{getattr(e, 'lineno', '?')}"
        raise SubmitError(f"slurm.template {s.template!r}: {where}: {e}") from None


def check_inputs(cfg: Config) -> list[str]:
    """What would make the job fail at once on the cluster: missing data, tokenizer or init_from paths."""
    from maester.data.sources import check_source
    from maester.hub import is_hub_id

    problems = []
    sources = [("sources", i, s, cfg.data.mode) for i, s in enumerate(cfg.data.sources)]
    sources += [("validation", i, s, "pretrain") for i, s in enumerate(cfg.data.validation)]
    for key, i, source, mode in sources:
        if source.path.startswith("builtin:"):
            continue
        try:
            check_source(source, mode)  # the files found as training finds them (indexed, llm.c, text, Hub)
        except (FileNotFoundError, ValueError) as e:
            problems.append(f"data.{key}[{i}].path: {e}")
    if cfg.tokenizer.path is not None and not Path(cfg.tokenizer.path).exists() and not is_hub_id(cfg.tokenizer.path):
        problems.append(f"tokenizer.path: {cfg.tokenizer.path} does not exist")
    if cfg.checkpoint.init_from:
        source = cfg.checkpoint.init_from_path
        if not Path(source).exists() and not (source != cfg.checkpoint.init_from and is_hub_id(source)):
            problems.append(f"checkpoint.init_from: {source} does not exist")
    return problems


def sbatch(script: Path, dependency: str | None = None) -> str:
    """Submit `script`; returns the SLURM job id."""
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch is not on PATH: this machine is not a SLURM login node (use --no-submit to "
                          "only write the job directory, or `maester launch` to run it here)")
    cmd = ["sbatch", "--parsable"] + ([f"--dependency={dependency}"] if dependency else []) + [str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SubmitError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def submit_job(job_dir: Path, chain: int = 1, after: str | None = None) -> list[str]:
    """Submit the job's slurm.sh `chain` times, each link waiting for the previous one to end (`afterany`), the
    first after `after` when given. Records and returns the job ids."""
    if chain < 1:
        raise SubmitError(f"--chain {chain}: must be at least 1")
    ids: list[str] = []
    for link in range(chain):
        previous = ids[-1] if ids else after
        job_id = sbatch(job_dir / "slurm.sh", f"afterany:{previous}" if previous else None)
        ids.append(job_id)
        record_job(job_dir, {"job_id": job_id, "event": "submit", "link": link + 1, "chain": chain,
                             "after": previous})
    return ids


def record_job(job_dir: Path, record: dict) -> None:
    """Append one line to `slurm_jobs.jsonl`, with the time first after the job id."""
    record = {"job_id": record["job_id"], "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), **record}
    with open(Path(job_dir) / JOB_IDS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def recorded_jobs(job_dir: Path) -> list[dict]:
    """The records of a job directory, oldest first: each submission (`event` "submit", or no event in records
    written before restarts existed), each restart after a failure ("restart") and the post-processing job
    ("after")."""
    path = Path(job_dir) / JOB_IDS_FILE
    if not path.is_file():
        return []
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
            problem = _record_problem(record)
            if problem:
                raise ValueError(f"{path}:{i}: not a job record: {problem}")
            records.append(record)
    return records


RECORD_FIELDS = {"restart": {"restart": int, "exit_code": int, "cause": str}, "after": {"step": int}}
"""What each kind of record (`event`) holds besides its `job_id`, for `status`, `cancel` and `max_restarts`."""


def _record_problem(record) -> str | None:
    """What is wrong with one line of `slurm_jobs.jsonl`, or None."""
    if not isinstance(record, dict):
        return f"expected an object, got {type(record).__name__}"
    job_id = record.get("job_id")
    if not isinstance(job_id, str) or not job_id.replace("_", "").isdigit():
        return f"'job_id' must be a SLURM job id (digits), got {job_id!r}"
    event = record.get("event", "submit")
    if event not in ("submit", *RECORD_FIELDS):
        return f"unknown event {event!r}"
    for key, kind in RECORD_FIELDS.get(event, {}).items():
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            return f"a {event!r} record needs {key!r} ({kind.__name__}), got {record.get(key)!r}"
    return None


def training_jobs(records: list[dict]) -> list[dict]:
    """The records of jobs that train (submissions and restarts), not the post-processing job."""
    return [r for r in records if r.get("event", "submit") in ("submit", "restart")]


def restarts_since_submission(records: list[dict]) -> list[dict]:
    """The restarts after failures since the last `maester submit` (or sweep retry): what `slurm.max_restarts`
    counts."""
    since = training_jobs(records)
    last_submit = max((i for i, r in enumerate(since) if r.get("event", "submit") == "submit"), default=-1)
    return [r for r in since[last_submit + 1:] if r.get("event") == "restart"]


ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED",
                 "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"}


def slurm_state(job_id: str) -> str:
    """The SLURM state of a job: squeue while it is queued or running, then sacct, then scontrol."""
    for cmd in (["squeue", "-h", "-j", job_id, "-o", "%T"], ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                ["scontrol", "show", "job", job_id]):
        if shutil.which(cmd[0]) is None:
            continue
        out = subprocess.run(cmd, capture_output=True, text=True)
        text = out.stdout.strip()
        if out.returncode != 0 or not text:
            continue
        if cmd[0] == "scontrol":
            for field in text.split():
                if field.startswith("JobState="):
                    return field.split("=", 1)[1]
            continue
        return text.splitlines()[0].split()[0].rstrip("+")
    return "UNKNOWN"


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """`slurm_state` of several jobs with one squeue and one sacct call (scontrol for those both miss), not up to
    three calls per job: `maester status` of a long chain answers in a second."""
    states: dict[str, str] = {}
    ids = list(dict.fromkeys(job_ids))
    for cmd in (["squeue", "-h", "-o", "%i %T", "-j"], ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j"]):
        missing = [j for j in ids if j not in states]
        if not missing or shutil.which(cmd[0]) is None:
            continue
        out = subprocess.run([*cmd, ",".join(missing)], capture_output=True, text=True)
        for line in out.stdout.splitlines():
            fields = line.replace("|", " ").split()
            if len(fields) >= 2 and fields[0] in missing and fields[0] not in states:
                states[fields[0]] = fields[1].rstrip("+")
    return {j: states[j] if j in states else slurm_state(j) for j in ids}


def cancel_jobs(job_ids: list[str]) -> list[str]:
    """`scancel` those of `job_ids` still queued or running; returns them. Without SLURM's tools on PATH nothing can
    be known or cancelled: an error, not "nothing running"."""
    missing = [tool for tool in ("squeue", "scancel") if shutil.which(tool) is None]
    if missing:
        raise SubmitError(f"{' and '.join(missing)} not on PATH: SLURM cannot be reached from here, so the job's "
                          f"SLURM jobs ({', '.join(dict.fromkeys(job_ids))}) are neither known nor cancelled; run "
                          f"this on a login node of the cluster")
    active = [j for j in dict.fromkeys(job_ids) if slurm_state(j) in ACTIVE_STATES]
    if active:
        out = subprocess.run(["scancel", *active], capture_output=True, text=True)
        if out.returncode != 0:
            raise SubmitError(f"scancel {' '.join(active)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return active


def describe_restarts(records: list[dict]) -> list[str]:
    """One line per restart after a failure, oldest first: when, which job, the cause, the step it resumed from."""
    return [f"{r['restart']} of {r.get('max_restarts', '?')}: job {r.get('failed_job', '?')} failed with exit code "
            f"{r['exit_code']} ({r['cause']})" + (f" on rank {r['rank']}" if r.get("rank") is not None else "")
            + f" at {r.get('submitted', '?')}; resumed from step {r.get('step') or 0} as job {r['job_id']}"
            for r in records if r.get("event") == "restart"]
