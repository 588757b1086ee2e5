"""Sweep files expand to the points they say; bad ones are errors naming the key. (Submitting, status, cancel,
retry and report against a real SLURM are in tests/slurm.)"""

from __future__ import annotations

import json
import re

import pytest

from maester.config import Config, ConfigError
from maester.jobs.sweep import expand, load_sweep, report, status, submit_sweep
from tests.helpers import DEMO_CONFIG


def sweep_file(tmp_path, body: str):
    path = tmp_path / "sweep.toml"
    path.write_text(f'name = "s"\nbase = "{DEMO_CONFIG}"\n' + body)
    return path


def test_product_of_a_list_and_a_logspace(tmp_path):
    _, points = expand(sweep_file(tmp_path, '[parameters]\n"optimizer.lr" = {logspace = [-4, -2, 3]}\n'
                                            '"model.overrides.n_layers" = [1, 2]\n'))
    assert [p["name"] for p in points] == [f"p{i:03d}" for i in range(6)]
    assert [p["params"]["optimizer.lr"] for p in points] == pytest.approx([1e-4, 1e-4, 1e-3, 1e-3, 1e-2, 1e-2])
    assert [p["params"]["model.overrides.n_layers"] for p in points] == [1, 2, 1, 2, 1, 2]
    assert points[2]["overrides"] == ["--optimizer.lr=0.001", "--model.overrides.n_layers=1"]


def test_zip_and_linspace_and_fixed(tmp_path):
    _, points = expand(sweep_file(tmp_path, 'mode = "zip"\n[fixed]\n"training.steps" = 7\n[parameters]\n'
                                            '"optimizer.lr" = {linspace = [0.1, 0.3, 3]}\n'
                                            '"optimizer.name" = ["adamw", "adamw", "adamw"]\n'))
    assert [p["params"]["optimizer.lr"] for p in points] == pytest.approx([0.1, 0.2, 0.3])
    assert all(p["overrides"][0] == "--training.steps=7" for p in points)


@pytest.mark.parametrize("body, message", [
    ('[parameters]\n"optimizer.lr" = []\n', "parameters.optimizer.lr is an empty list"),
    ('[parameters]\n"optimizer.lr" = {logspace = [1, 2]}\n', "logspace must be [start, stop, count]"),
    ('mode = "zip"\n[parameters]\n"a.b" = [1, 2]\n"c.d" = [1]\n', "lists of one length"),
    ('mode = "grid"\n[parameters]\n"a.b" = [1]\n', "mode 'grid'"),
    ('colour = "red"\n[parameters]\n"a.b" = [1]\n', "unknown keys colour"),
])
def test_bad_sweep_files(tmp_path, body, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        expand(sweep_file(tmp_path, body))


def test_submit_without_sbatch_writes_every_point_and_reports(tmp_path):
    path = sweep_file(tmp_path, '[fixed]\n"model.flavor" = "tiny"\n[parameters]\n"optimizer.lr" = [0.001, 0.002]\n')
    root = submit_sweep(path, [f"--job.dump_dir={tmp_path / 'jobs'}"], no_submit=True)
    assert root == tmp_path / "jobs" / "s"
    assert [p["name"] for p in load_sweep(root)["points"]] == ["p000", "p001"]
    cfg = Config.from_json_file(root / "p001" / "config.json")
    assert cfg.optimizer.lr == 0.002 and cfg.job.name == "p001" and cfg.model.flavor == "tiny"
    # A point with a few logged steps shows them in status and the report.
    (root / "p000" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n"
                                                         for s in (1, 2, 3)))
    rows = status(root)
    assert [(r["job"], r["state"], r["step"], r["loss"]) for r in rows] == [
        ("p000", "NOT SUBMITTED", 3, 2.0), ("p001", "NOT SUBMITTED", None, None)]
    csv_path, png_path = report(root)
    assert csv_path.read_text().splitlines()[1].startswith("p000,,NOT SUBMITTED,0.001,3,2.0")
    assert png_path.stat().st_size > 10_000
    with pytest.raises(Exception, match="submitted already"):
        submit_sweep(path, [f"--job.dump_dir={tmp_path / 'jobs'}"], no_submit=True)


def test_an_lr_axis_has_a_readable_tick_at_each_swept_value():
    """The walkthrough's sweep PNG had a linear LR axis with overlapping ticks (0.00100.00125...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from maester.jobs.sweep import parameter_axis

    fig, ax = plt.subplots()
    ax.scatter([1e-3, 3e-3, 1e-3], [2.0, 1.9, 2.1])
    parameter_axis(ax, [1e-3, 3e-3, 1e-3])
    fig.canvas.draw()
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.001", "0.003"]
    assert [t.get_text() for t in ax.get_xticklabels(minor=True)] == []
    ax2 = fig.add_subplot(2, 1, 2)
    parameter_axis(ax2, [64, 96])  # a narrow numeric range stays linear
    assert ax2.get_xscale() == "linear" and [t.get_text() for t in ax2.get_xticklabels()] == ["64", "96"]
    plt.close(fig)


def test_lr_transfer_sweep_runs_here_and_reports_the_best_lr_per_width(tmp_path):
    """The shipped LR-transfer sweep, cut to 2 widths x 2 LRs of 3 steps: `sweep run` trains every point without
    SLURM, `status` says COMPLETED, and `report --transfer` plots and names each width's best LR."""
    from tests.helpers import REPO, run_maester

    sweep_file = tmp_path / "transfer.toml"
    sweep_file.write_text(f'''name = "transfer"
base = "{REPO / "configs" / "mup" / "lr-transfer.toml"}"
[fixed]
"training.steps" = 3
"schedule.warmup_steps" = 1
"data.seq_len" = 32
[parameters]
"mup.enabled" = [true]
"model.width" = [64, 128]
"optimizer.lr" = [1e-4, 1e-2]
''')
    jobs = tmp_path / "jobs"
    out = run_maester(["sweep", "submit", str(sweep_file), "--no-submit", f"--job.dump_dir={jobs}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    root = jobs / "transfer"
    ran = run_maester(["sweep", "run", str(root)], tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "trained p000 p001 p002 p003" in ran.stdout
    assert {r["state"] for r in status(root)} == {"COMPLETED"}
    again = run_maester(["sweep", "run", str(root)], tmp_path)
    assert "every point has completed" in again.stdout

    rep = run_maester(["sweep", "report", str(root), "--transfer"], tmp_path)
    assert rep.returncode == 0, rep.stderr[-3000:]
    # 3 steps at LR 1e-4 barely move the loss; 1e-2 lowers it at both widths
    assert "mup.enabled=true: best optimizer.lr per width: 64: 0.01, 128: 0.01" in rep.stdout
    assert (root / "transfer.png").read_bytes()[:4] == b"\x89PNG"

    bad = run_maester(["sweep", "report", str(root), "--transfer", "--width-key", "model.dim"], tmp_path)
    assert bad.returncode == 2 and "the sweep has no parameter 'model.dim'" in bad.stderr


def test_a_report_that_fails_leaves_neither_file(tmp_path, monkeypatch):
    """report.csv and report.png appear together and whole: a failure while drawing leaves no CSV behind."""
    import matplotlib.figure

    path = sweep_file(tmp_path, '[fixed]\n"model.flavor" = "tiny"\n[parameters]\n"optimizer.lr" = [0.001]\n')
    root = submit_sweep(path, [f"--job.dump_dir={tmp_path / 'jobs'}"], no_submit=True)
    assert (root / "sweep.json").is_file() and not list(root.glob(".sweep.json.*"))

    def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    with pytest.raises(OSError):
        report(root)
    assert sorted(p.name for p in root.iterdir() if not p.is_dir()) == ["sweep.json"]


def test_sweep_run_keeps_the_logs_of_a_failed_attempt(tmp_path):
    from maester.jobs.sweep import SubmitError, run_here

    data = tmp_path / "gone.jsonl"
    data.write_text(json.dumps({"text": "a document"}) + "\n")
    path = sweep_file(tmp_path, f'[fixed]\n"model.flavor" = "tiny"\n"data.sources" = [{{path = "{data}"}}]\n'
                                '[parameters]\n"optimizer.lr" = [0.001]\n')
    root = submit_sweep(path, [f"--job.dump_dir={tmp_path / 'jobs'}"], no_submit=True)
    data.unlink()  # the point fails when it runs
    for _ in range(2):
        with pytest.raises(SubmitError, match="p000 failed"):
            run_here(root)
    assert (root / "p000" / "logs" / "local.err").read_text().count("gone.jsonl") == 2
