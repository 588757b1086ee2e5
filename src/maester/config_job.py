"""The job's sections of the config tree: its name and directory (`job`), and how it is submitted to SLURM
(`slurm`, with its `container`). Every value that ends up in the job script is checked here, at load time."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maester.config_base import Section


NAME_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def check_name(value, key: str) -> None:
    """A job or sweep name: one path component of letters, digits, '-', '_' and '.' (it becomes a directory and
    goes into the job script)."""
    if not isinstance(value, str) or not value or set(value) - NAME_CHARACTERS or value.startswith("."):
        raise ValueError(f"{key} {value!r} may only contain letters, digits, '-', '_' and '.'")


def check_script_value(value: str | None, key: str, spaces: bool = True) -> None:
    """A value the job script holds: no control character (a newline would start a shell line of its own, and
    sbatch ignores the #SBATCH lines after it); no space or quote where an #SBATCH option takes it bare."""
    if value is None:
        return
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{key} {value!r} holds a control character (a newline, a tab, ...): refused, as it would "
                         f"break the job script")
    if not spaces and any(ch.isspace() or ch in "\"'`$;&|<>#\\" for ch in value):
        raise ValueError(f"{key} {value!r} holds a space, a quote, '#', a backslash or a shell character: an "
                         f"#SBATCH option takes one plain word (sbatch reads '#' as a comment, '\\' as an escape)")


class JobConfig(Section):
    name: str = "demo"
    """Job name: the job directory is `<dump_dir>/<name>`."""
    dump_dir: str = "jobs"

    @model_validator(mode="after")
    def _check_name(self) -> "JobConfig":
        check_name(self.name, "job.name")
        check_script_value(self.dump_dir, "job.dump_dir")
        if '"' in self.dump_dir or "\\" in self.dump_dir:
            raise ValueError(f"job.dump_dir {self.dump_dir!r} holds a double quote or a backslash, which the job "
                             f"script's #SBATCH --output line cannot take (sbatch reads a backslash as an escape)")
        return self


class ContainerConfig(Section):
    runtime: Literal["none", "singularity", "apptainer"] = "none"
    """Run each node's launcher inside a container image (`singularity exec` / `apptainer exec`), or directly."""
    image: str | None = None
    """The image (`.sif`) for a container runtime."""
    binds: list[str] = Field(default_factory=list)
    """`--bind` mounts, e.g. `["/scratch", "/project/data:/data"]`; the working and job directories are added."""
    options: list[str] = Field(default_factory=list)
    """More `exec` options, e.g. `["--rocm"]` (AMD) or `["--nv"]` (NVIDIA)."""

    @model_validator(mode="after")
    def _check_image(self) -> "ContainerConfig":
        if self.runtime != "none" and not self.image:
            raise ValueError(f"slurm.container.image is required when slurm.container.runtime = {self.runtime!r}")
        return self


class SlurmConfig(Section):
    """How `maester submit` renders `jobs/<name>/slurm.sh` and submits it."""

    template: str = "default"
    """`default`, `lumi` (LUMI-G: 8 GCDs per node, ROCm, Singularity), or the path of your own Jinja2 template."""
    nodes: int = Field(1, ge=1)
    min_nodes: int | None = Field(None, ge=1)
    """Let SLURM start the job, and a requeued job, on as few as this many of `nodes` (`--nodes=min_nodes-nodes`):
    it may then run on fewer nodes, even with more idle (SLURM 22.05 with select/cons_tres starts such a job on
    `min_nodes`), resuming on fewer ranks with the same data order; the parallel layout must fit every node count
    in the range. None: always `nodes`, and a job requeued after a node died waits until that many are up."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs (GCDs) per node requested with `--gpus-per-node`; 0: none (a CPU job)."""
    gpu: str | None = None
    """The nodes' GPU model, for the plan `maester submit` makes first and `maester plan` (its memory and peak
    FLOPs): h100, h100-nvl, h200, a100, b200, mi250x, mi300x, ... (`maester plan --help` lists them); None: mi250x
    with the lumi template, else h100."""
    nproc_per_node: int | None = Field(None, ge=1)
    """Training processes per node; None: `gpus_per_node`, or 1 without GPUs."""
    cpus_per_task: int | None = Field(None, ge=1)
    """CPUs of each node's task (the torchrun launcher and all its workers); None: 8 per GPU with GPUs (many
    clusters give a task one core by default), else the cluster's default. Passed on to srun."""
    mem: str | None = None
    """`--mem` per node, e.g. `"480G"`; None: the cluster's default."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    """Walltime (`--time`); a longer run needs `--chain K` or requeues itself when warned of the limit."""
    exclusive: bool = False
    signal_seconds: int = Field(300, ge=0)
    """Ask SLURM for a warning this many seconds before the time limit (`--signal=B:USR1@N`): the trainer then
    checkpoints and the job requeues itself. 0: no warning."""
    requeue: bool = True
    """Requeue the job (`scontrol requeue`) after a checkpoint forced by the warning or a preemption."""
    max_restarts: int = Field(0, ge=0)
    """Restart the job after a failure (a crash, a killed process, out of memory, a collective timeout), up to this
    many times per submission, resuming from `latest`: `scontrol requeue`, else `sbatch` of the script again. A bad
    config or input (exit 2), a non-finite loss (4) and Ctrl-C (130) are never retried. Each restart is a line of
    `slurm_jobs.jsonl`. Stops for the walltime or a preemption are not failures and do not count."""
    after: list[str] = Field(default_factory=list)
    """Shell commands of a post-processing job (`after.sh`), submitted once when training completes, e.g.
    `['maester convert to-hf "$JOB_DIR" "$JOB_DIR/hf"']`; they run in order in the working directory, with
    `JOB_DIR` set and `maester` the job's own (its Python and container), and the first that fails ends the job."""
    after_sbatch: list[str] = Field(default_factory=list)
    """More `#SBATCH` lines for the post-processing job (one node, one task, no GPUs, the job's partition,
    account, qos, time, mem and cpus), e.g. `["--partition=small", "--time=02:00:00"]`."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """More `#SBATCH` lines, without the prefix, e.g. `["--mail-type=END", "--constraint=a100"]`."""
    modules: list[str] = Field(default_factory=list)
    """`module load` these before the run."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment exported in the script, e.g. `{NCCL_DEBUG = "WARN"}`."""
    pre_run: list[str] = Field(default_factory=list)
    """Shell commands run before training (after modules and env), e.g. activating an environment."""
    python: str | None = None
    """The Python that runs maester on the nodes; None: the one that runs `maester submit` (a shared
    filesystem), or `python3` inside a container."""
    container: ContainerConfig = Field(default_factory=ContainerConfig)

    @model_validator(mode="after")
    def _check_lines(self) -> "SlurmConfig":
        # first: a control character is named as such, whatever else a value gets wrong
        for key in ("partition", "account", "qos", "mem", "time"):
            check_script_value(getattr(self, key), f"slurm.{key}", spaces=False)
        check_script_value(self.gpu, "slurm.gpu", spaces=False)
        for key in ("python", "template"):
            check_script_value(getattr(self, key), f"slurm.{key}")
        for i, value in enumerate(self.modules):
            check_script_value(value, f"slurm.modules[{i}]")
        for name, value in self.env.items():
            check_script_value(value, f"slurm.env.{name}")
        check_script_value(self.container.image, "slurm.container.image")
        for key in ("binds", "options"):
            for i, value in enumerate(getattr(self.container, key)):
                check_script_value(value, f"slurm.container.{key}[{i}]")
        for key in ("extra_sbatch", "after_sbatch"):
            for i, line in enumerate(getattr(self, key)):
                check_script_value(line, f"slurm.{key}[{i}]")
                if line.startswith("#") or "\n" in line or not line.startswith("-"):
                    raise ValueError(f"slurm.{key}: {line!r} must be one sbatch option such as '--qos=high' "
                                     f"(without '#SBATCH')")
        for i, command in enumerate(self.after):
            check_script_value(command, f"slurm.after[{i}]")
            if not command.strip():
                raise ValueError(f"slurm.after[{i}] is empty: give a shell command, e.g. 'maester convert to-hf "
                                 f"\"$JOB_DIR\" \"$JOB_DIR/hf\"'")
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"slurm.min_nodes = {self.min_nodes} is more than slurm.nodes = {self.nodes}: the job "
                             f"runs on min_nodes to nodes nodes")
        if not all(part.isdigit() for part in self.time.replace("-", ":").split(":")):
            raise ValueError(f"slurm.time {self.time!r} is not a SLURM time such as '02:00:00' or '1-12:00:00'")
        for key in self.env:
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise ValueError(f"slurm.env: {key!r} is not an environment variable name")
        return self
