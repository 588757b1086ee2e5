"""Values that reach the job script cannot inject shell lines: a newline (or any control character) in a SLURM
field, a container setting, an #SBATCH line or the dump directory is refused with the key named; a space, a '#' or
a backslash in an #SBATCH option's word is refused; the job directory's path is quoted on the --output/--error
lines (sbatch reads the quotes) with '%' doubled (sbatch's pattern escape), and a real sbatch puts the logs there;
a sweep's name must be one safe path component (more in test_sweep_names.py)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time

import pytest

from tests.helpers import DEMO_CONFIG, run_maester

FIELDS = ["slurm.partition", "slurm.account", "slurm.qos", "slurm.mem", "job.dump_dir"]


@pytest.mark.parametrize("key", FIELDS)
def test_a_newline_in_a_script_field_is_refused_and_runs_nothing(tmp_path, key):
    marker = tmp_path / f"PWNED_{key}"
    value = f"debug\ntouch {marker}" if key != "job.dump_dir" else f"{tmp_path}/d\ntouch {marker}"
    args = ["submit", str(DEMO_CONFIG), "--no-submit", "--name=p1", f"--{key}={value}"]
    if key != "job.dump_dir":
        args.append(f"--job.dump_dir={tmp_path}/sub")
    out = run_maester(args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{key} " in out.stderr and "control character" in out.stderr
    for script in tmp_path.rglob("slurm.sh"):  # nothing written; and were it written, running it creates nothing
        subprocess.run(["bash", "-n", str(script)])
    assert not list(tmp_path.rglob("slurm.sh")) and not marker.exists()


@pytest.mark.parametrize("value", ["de bug", "a;b", "$(id)"])
def test_an_sbatch_word_with_a_space_or_shell_character_is_refused(tmp_path, value):
    out = run_maester(["submit", str(DEMO_CONFIG), "--no-submit", "--name=p2", f"--job.dump_dir={tmp_path}/sub",
                       f"--slurm.partition={value}"], cwd=tmp_path)
    assert out.returncode == 2 and "slurm.partition" in out.stderr, out.stderr[-2000:]


def test_a_dump_dir_with_a_space_is_quoted(tmp_path):
    dump = tmp_path / "sub dir"
    out = run_maester(["submit", str(DEMO_CONFIG), "--no-submit", "--name=p3", f"--job.dump_dir={dump}"],
                      cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    script = (dump / "p3" / "slurm.sh").read_text()
    assert f'#SBATCH --output="{dump}/p3/logs/%j.out"' in script
    assert f'#SBATCH --error="{dump}/p3/logs/%j.err"' in script
    assert subprocess.run(["bash", "-n", str(dump / "p3" / "slurm.sh")]).returncode == 0


SWEEP = """name = {name}
base = "{base}"
[parameters]
"optimizer.lr" = [1e-3, 2e-3]
"""


@pytest.mark.parametrize("name", ['"../../escaped"', '""', '"a/b"', "5"])
def test_a_sweep_name_must_be_one_safe_component(tmp_path, name):
    sweep = tmp_path / "sw.toml"
    sweep.write_text(SWEEP.format(name=name, base=DEMO_CONFIG))
    out = run_maester(["sweep", "submit", str(sweep), "--no-submit", f"--job.dump_dir={tmp_path}/jobs"],
                      cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and f"{sweep}: name" in out.stderr
    assert not (tmp_path / "escaped").exists() and not os.path.exists(tmp_path.parent / "escaped")


CONTAINER = ["--slurm.container.runtime=singularity", "--slurm.container.image=/images/torch.sif"]
# Every other config value the job script holds, as the command line sets it with a newline in it.
OTHER_FIELDS = {
    "slurm.time": lambda bad: [f"--slurm.time={bad}"],
    "slurm.python": lambda bad: [f"--slurm.python={bad}"],
    "slurm.extra_sbatch[0]": lambda bad: ["--slurm.extra_sbatch=" + json.dumps([bad])],
    "slurm.after_sbatch[0]": lambda bad: ["--slurm.after_sbatch=" + json.dumps([bad])],
    "slurm.after[0]": lambda bad: ["--then", bad],
    "slurm.modules[0]": lambda bad: ["--slurm.modules=" + json.dumps([bad])],
    "slurm.env.HF_HOME": lambda bad: ["--slurm.env=" + json.dumps({"HF_HOME": bad})],
    "slurm.container.image": lambda bad: [CONTAINER[0], f"--slurm.container.image={bad}"],
    "slurm.container.binds[0]": lambda bad: [*CONTAINER, "--slurm.container.binds=" + json.dumps([bad])],
    "slurm.container.options[0]": lambda bad: [*CONTAINER, "--slurm.container.options=" + json.dumps([bad])],
}


@pytest.mark.parametrize("key", sorted(OTHER_FIELDS))
@pytest.mark.parametrize("separator", ["\n", "\r", "\x0b"])
def test_every_other_script_value_refuses_control_characters(tmp_path, key, separator):
    marker = tmp_path / "PWNED_other"
    args = OTHER_FIELDS[key](f"--x{separator}touch {marker}")
    out = run_maester(["submit", str(DEMO_CONFIG), "--no-submit", "--name=p4", f"--job.dump_dir={tmp_path}/sub",
                       *args], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{key} " in out.stderr and "control character" in out.stderr and "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("slurm.sh")) and not marker.exists()


@pytest.mark.parametrize("key", ["slurm.partition", "slurm.account", "slurm.qos", "slurm.mem"])
@pytest.mark.parametrize("value", ["gpu#a100", "gpu\\a100"])
def test_an_sbatch_word_with_a_hash_or_backslash_is_refused(tmp_path, key, value):
    """sbatch reads an unquoted '#' on an #SBATCH line as the start of a comment and a backslash as an escape:
    `--partition=gpu#a100` would ask for partition `gpu`."""
    out = run_maester(["submit", str(DEMO_CONFIG), "--no-submit", "--name=p5", f"--job.dump_dir={tmp_path}/sub",
                       f"--{key}={value}"], cwd=tmp_path)
    assert out.returncode == 2 and f"{key} " in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.rglob("slurm.sh"))


def test_a_dump_dir_with_a_backslash_is_refused(tmp_path):
    """sbatch drops a backslash from --output and then expands no %j: every job would write one log file."""
    out = run_maester(["submit", str(DEMO_CONFIG), "--no-submit", "--name=p6", f"--job.dump_dir={tmp_path}/a\\b"],
                      cwd=tmp_path)
    assert out.returncode == 2 and "job.dump_dir " in out.stderr and "backslash" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.rglob("slurm.sh"))


def test_a_job_directory_under_a_backslash_is_refused_when_rendered(tmp_path):
    """A relative dump_dir under a working directory whose path holds a backslash."""
    from maester.config import load_config
    from maester.jobs.slurm import SubmitError, render_slurm_script

    cfg = load_config(DEMO_CONFIG, ["--job.dump_dir=jobs"], environ={})
    with pytest.raises(SubmitError, match="backslash"):
        render_slurm_script(cfg, tmp_path / "a\\b" / "jobs" / "demo", tmp_path)


def test_a_percent_in_the_dump_dir_is_doubled_on_the_sbatch_lines(tmp_path):
    """sbatch expands %-patterns in --output (%j the job id); '%%' is a literal '%'. The shell lines keep one."""
    dump = tmp_path / "100% sure"
    out = run_maester(["submit", str(DEMO_CONFIG), "--no-submit", "--name=p7", f"--job.dump_dir={dump}"],
                      cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    script = (dump / "p7" / "slurm.sh").read_text()
    escaped = str(dump).replace("%", "%%")
    assert f'#SBATCH --output="{escaped}/p7/logs/%j.out"' in script.splitlines()
    assert f'#SBATCH --error="{escaped}/p7/logs/%j.err"' in script.splitlines()
    assert f"JOB_DIR={shlex.quote(str(dump / 'p7'))}" in script.splitlines()


def _slurm_up() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "up" in out.stdout


@pytest.mark.skipif(not _slurm_up(), reason="no SLURM cluster answers here (scripts/slurm/local-cluster.sh)")
def test_sbatch_writes_the_logs_into_a_dump_dir_with_a_space_a_hash_and_a_percent(tmp_path):
    """The rendered #SBATCH lines, as a real sbatch reads them: the logs land in <job dir>/logs/<job id>.out|err
    even when the job directory's path holds a space, a '#' and a '%'. (The script's body is replaced by an echo:
    the training run itself is tested in tests/slurm.)"""
    dump = tmp_path / "sp ace#1 100%x"  # %x: sbatch would put the job name there
    out = run_maester(["submit", str(DEMO_CONFIG), "--no-submit", "--name=p8", f"--job.dump_dir={dump}",
                       "--slurm.time=00:02:00"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    job_dir = dump / "p8"
    header = [line for line in (job_dir / "slurm.sh").read_text().splitlines() if line.startswith("#")]
    probe = tmp_path / "probe.sh"
    probe.write_text("\n".join(header) + "\necho out-line\necho err-line >&2\n")
    sub = subprocess.run(["sbatch", "--parsable", str(probe)], capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    out_log, err_log = job_dir / "logs" / f"{job_id}.out", job_dir / "logs" / f"{job_id}.err"
    deadline = time.time() + 120
    while time.time() < deadline and not ("out-line" in _read(out_log) and "err-line" in _read(err_log)):
        time.sleep(1)
    subprocess.run(["scancel", job_id], capture_output=True)  # a no-op once it has ended
    assert "out-line" in _read(out_log), sorted(str(p) for p in tmp_path.rglob("*"))
    assert "err-line" in _read(err_log)


def _read(path) -> str:
    return path.read_text() if path.is_file() else ""
