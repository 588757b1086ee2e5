"""Values that reach the job script cannot inject shell lines: a newline (or any control character) in a SLURM
field or the dump directory is refused with the key named, a space in an #SBATCH option's word is refused, the
job directory's path is quoted on the --output/--error lines (sbatch reads the quotes), and a sweep's name must
be one safe path component."""

from __future__ import annotations

import os
import subprocess

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
