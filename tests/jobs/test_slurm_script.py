"""The job script: golden renderings of the default and LUMI templates, user templates, checks before
submitting, and `maester launch` (the same job directory run locally)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maester.config import load_config
from maester.jobs.slurm import SubmitError, render_slurm_script
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides

GOLDEN = Path(__file__).parent / "golden"
JOB_DIR, WORKDIR = Path("/scratch/project_465000001/maester/jobs/llama-8b"), Path("/scratch/project_465000001/maester")

CASES = {
    "default": [
        "--job.name=llama-8b", "--slurm.nodes=2", "--slurm.gpus_per_node=4", "--slurm.cpus_per_task=32",
        "--slurm.mem=480G", "--slurm.partition=gpu", "--slurm.account=proj42", "--slurm.time=1-12:00:00",
        "--slurm.exclusive=true", '--slurm.extra_sbatch=["--mail-type=END"]', '--slurm.modules=["cuda/12.4"]',
        '--slurm.env={"NCCL_DEBUG": "WARN", "HF_HOME": "/scratch/hf cache"}',
        '--slurm.pre_run=["source /opt/venv/bin/activate"]', "--slurm.python=/opt/venv/bin/python",
    ],
    "lumi": [
        "--job.name=llama-8b", "--slurm.template=lumi", "--slurm.nodes=16", "--slurm.account=project_465000001",
        "--slurm.time=2-00:00:00", "--slurm.container.runtime=singularity",
        "--slurm.container.image=/appl/local/containers/rocm-pytorch.sif",
        '--slurm.container.binds=["/scratch/project_465000001", "/flash/project_465000001"]',
        "--slurm.python=/opt/venv/bin/python", "--slurm.signal_seconds=600",
    ],
}


def render(case: str) -> str:
    cfg = load_config(DEMO_CONFIG, CASES[case], environ={})
    return render_slurm_script(cfg, JOB_DIR, WORKDIR)


@pytest.mark.parametrize("case", sorted(CASES))
def test_templates_render_their_golden_files(case):
    text = render(case)
    golden = GOLDEN / f"{case}.sh"
    if os.environ.get("MAESTER_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    syntax = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr


def test_the_rendered_script_holds_what_the_config_says():
    default, lumi = render("default"), render("lumi")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --account=proj42",
                 "#SBATCH --time=1-12:00:00", "#SBATCH --exclusive", "#SBATCH --mail-type=END",
                 "#SBATCH --signal=B:USR1@300", "module load cuda/12.4", "export HF_HOME='/scratch/hf cache'",
                 "source /opt/venv/bin/activate", f"#SBATCH --output=\"{JOB_DIR}/logs/%j.out\""):
        assert line in default.splitlines(), line
    assert "--nproc_per_node=4" in default and "singularity" not in default
    assert ("singularity exec --bind=/scratch/project_465000001/maester "
            "--bind=/scratch/project_465000001/maester/jobs/llama-8b --bind=/scratch/project_465000001 "
            "--bind=/flash/project_465000001 /appl/local/containers/rocm-pytorch.sif /opt/venv/bin/python") in lumi
    assert "--nproc_per_node=8" in lumi and "#SBATCH --partition=standard-g" in lumi
    assert "#SBATCH --signal=B:USR1@600" in lumi


def test_a_user_template_gets_the_same_variables_and_undefined_ones_are_errors(tmp_path):
    good = tmp_path / "mine.sh.j2"
    good.write_text("#!/bin/bash\n#SBATCH --job-name={{ job_name }}\n#SBATCH --nodes={{ slurm.nodes }}\n"
                    '{% include "run.sh.j2" %}')
    cfg = load_config(DEMO_CONFIG, [f"--slurm.template={good}"], environ={})
    text = render_slurm_script(cfg, JOB_DIR, WORKDIR)
    assert text.startswith("#!/bin/bash\n#SBATCH --job-name=demo\n#SBATCH --nodes=1\n")
    assert '-m maester train "$JOB_DIR"' in text
    bad = tmp_path / "bad.sh.j2"
    bad.write_text("#SBATCH --gres={{ slurm.gres }}\n")
    with pytest.raises(SubmitError, match=r"slurm.template .*bad.sh.j2.*gres"):
        render_slurm_script(load_config(DEMO_CONFIG, [f"--slurm.template={bad}"], environ={}), JOB_DIR, WORKDIR)
    with pytest.raises(SubmitError, match="neither 'default' nor 'lumi' nor a file"):
        render_slurm_script(load_config(DEMO_CONFIG, ["--slurm.template=missing.j2"], environ={}), JOB_DIR, WORKDIR)


@pytest.mark.parametrize("override, message", [
    ('--slurm.extra_sbatch=["#SBATCH --qos=x"]', "slurm.extra_sbatch"),
    ("--slurm.time=two hours", "slurm.time"),
    ("--slurm.container.runtime=apptainer", "slurm.container.image is required"),
    ('--slurm.env={"BAD-NAME": "1"}', "slurm.env"),
])
def test_bad_slurm_settings_are_config_errors(override, message, tmp_path):
    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG), override], tmp_path)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_submit_checks_inputs_before_writing_anything(tmp_path):
    out = run_maester(["submit", str(DEMO_CONFIG), '--data.sources=[{"path": "missing/*.parquet"}]',
                       "--tokenizer.kind=hf", "--tokenizer.path=nowhere/tokenizer.json"], tmp_path)
    assert out.returncode == 2
    assert "data.sources[0].path" in out.stderr and "tokenizer.path: nowhere/tokenizer.json" in out.stderr
    assert not (tmp_path / "jobs").exists()


def test_submit_without_sbatch_says_so(tmp_path):
    env = clean_env(PATH=str(Path(sys.executable).parent))  # no sbatch here, even on a SLURM machine
    out = run_maester(["submit", str(DEMO_CONFIG)], tmp_path, env=env)
    assert out.returncode == 2 and "sbatch is not on PATH" in out.stderr and "--no-submit" in out.stderr


def test_launch_runs_the_job_here_with_the_slurm_log_layout(corpus, tmp_path):
    made = run_maester(["submit", "--no-submit", str(DEMO_CONFIG),
                        *tiny_overrides(corpus, tmp_path / "jobs", "local", training__steps=2,
                                        checkpoint__interval=0)], tmp_path)
    assert made.returncode == 0, made.stderr
    job = tmp_path / "jobs" / "local"
    out = run_maester(["launch", str(job), "--nproc", "1"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    logs = job / "logs"
    assert os.readlink(logs / "latest.out").startswith("local-")
    log_text = (logs / "latest.out").read_text() + (logs / "latest.err").read_text()
    assert "step 2" in log_text or "step=2" in log_text or '"step": 2' in log_text
    assert "exited with status 0" in (logs / "latest.err").read_text()
    assert (job / "metrics.jsonl").is_file()
    assert (job / "checkpoints" / "latest").exists()


def test_cpus_per_task_follows_the_gpus_and_reaches_srun():
    def script(*overrides):
        return render_slurm_script(load_config(DEMO_CONFIG, list(overrides), environ={}), JOB_DIR, WORKDIR)

    lines = script("--slurm.gpus_per_node=4").splitlines()
    assert "#SBATCH --cpus-per-task=32" in lines  # 8 cores per GPU when unset
    assert 'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi' in lines
    assert "#SBATCH --cpus-per-task=20" in script("--slurm.gpus_per_node=4", "--slurm.cpus_per_task=20").splitlines()
    assert not any(line.startswith("#SBATCH --cpus-per-task") for line in script().splitlines())  # CPU job


def lumi_preparation(lines: list[str]) -> str:
    """The LUMI script's step that runs once on every node before training (N10)."""
    (line,) = [line for line in lines if line.startswith("srun --ntasks-per-node=1 ")]
    return line


def test_lumi_script_sets_up_the_network_binding_and_caches():
    lumi = render("lumi")
    lines = lumi.splitlines()
    for line in ("module use /appl/local/laifs/modules", "module load lumi-aif-singularity-bindings",
                 "export CXI_FORK_SAFE=1", "export CXI_FORK_SAFE_HP=1"):
        assert line in lines, line
    # The MIOpen directory is made on every node (a step of one task per node, in the container), not on the batch
    # host only, and numactl, which --numa-binding runs each rank under, is checked there.
    prepare = lumi_preparation(lines)
    assert lines.index(prepare) > lines.index('export MIOPEN_USER_DB_PATH="/tmp/${USER}-miopen-${SLURM_JOB_ID}"')
    assert "rocm-pytorch.sif bash -c 'mkdir -p \"$MIOPEN_USER_DB_PATH\"" in prepare and "numactl" in prepare
    assert "--numa-binding=exclusive" in lumi and "--numa-binding" not in render("default")
    # A shared small-g node: no binding (it needs whole nodes), so no numactl needed; the directory still made.
    shared = render_slurm_script(load_config(DEMO_CONFIG, CASES["lumi"] + ["--slurm.partition=small-g",
                                                                         "--slurm.gpus_per_node=2"], environ={}),
                                 JOB_DIR, WORKDIR)
    assert "--numa-binding" not in shared and "#SBATCH --exclusive" not in shared
    assert "numactl" not in lumi_preparation(shared.splitlines()) and "mkdir" in lumi_preparation(shared.splitlines())
