"""A sweep file's `name` names the sweep's directory under the dump directory: it must be one path component of
safe characters (the job-name rule), and every other key of the wrong type is a one-line error naming the sweep
file and the key, never a traceback; nothing is written outside the dump directory."""

from __future__ import annotations

import pytest

from tests.helpers import DEMO_CONFIG, run_maester

SWEEP = """{head}
[parameters]
"optimizer.lr" = [1e-3, 2e-3]
"""


def submit(tmp_path, head: str):
    work = tmp_path / "a" / "b" / "work"  # "../../.." from the dump dir <work>/jobs/x is tmp_path/a/b
    work.mkdir(parents=True)
    sweep = work / "sw.toml"
    sweep.write_text(SWEEP.format(head=head))
    out = run_maester(["sweep", "submit", str(sweep), "--no-submit", f"--job.dump_dir={work}/jobs/x"], cwd=work)
    return sweep, out


@pytest.mark.parametrize("name", ['"../../.."', '"../.."', '".."', '"."', '""', '"a/b"', '"/abs"', "5", "[]",
                                  '"a b"', '"a;b"', '"a\\nb"', '".hidden"'])
def test_a_sweep_name_that_is_not_one_safe_component_is_refused(tmp_path, name):
    sweep, out = submit(tmp_path, f'name = {name}\nbase = "{DEMO_CONFIG}"')
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{sweep}: name " in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p != sweep and p.is_file())
    assert written == [], written  # no sweep.json, no job directory, anywhere


@pytest.mark.parametrize("head, key", [
    ('name = "s"\nbase = 5', "base"),
    ('name = "s"\nbase = ""', "base"),
    (f'name = "s"\nbase = "{DEMO_CONFIG}"\ndump_dir = 5', "dump_dir"),
    (f'name = "s"\nbase = "{DEMO_CONFIG}"\nfixed = 5', "fixed"),
    (f'name = "s"\nbase = "{DEMO_CONFIG}"\nfixed = ["training.steps"]', "fixed"),
])
def test_a_sweep_key_of_the_wrong_type_is_one_line_naming_it(tmp_path, head, key):
    sweep, out = submit(tmp_path, head)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{sweep}: {key} " in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_parameters_that_are_not_a_table_are_named(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    sweep = work / "sw.toml"
    sweep.write_text(f'name = "s"\nbase = "{DEMO_CONFIG}"\nparameters = 5\n')
    out = run_maester(["sweep", "submit", str(sweep), "--no-submit", f"--job.dump_dir={work}/jobs"], cwd=work)
    assert out.returncode == 2 and f"{sweep}: parameters " in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (work / "jobs").exists()


def test_a_good_name_makes_the_sweep_directory_under_the_dump_dir(tmp_path):
    sweep, out = submit(tmp_path, f'name = "lr-sweep_2.b"\nbase = "{DEMO_CONFIG}"')
    assert out.returncode == 0, out.stderr[-2000:]
    assert (sweep.parent / "jobs" / "x" / "lr-sweep_2.b" / "sweep.json").is_file()
