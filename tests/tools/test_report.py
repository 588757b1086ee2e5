"""`maester report` on a real tiny job: finished, still running (copied without its marker, a half-written last
line), stopped for a requeue, with a non-finite step, and without metrics."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from PIL import Image

from maester.cli import main
from maester.config import load_config
from maester.jobs.job_dir import write_job_dir
from maester.tools.report import write_report
from maester.train.metrics_file import read_events, read_metrics
from maester.train.preemption import REQUEUE_FILE, write_marker
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides, write_corpus

STEPS = 8


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory):
    """8 steps of the tiny Llama with validation at steps 4 and 8 and one checkpoint at the end."""
    root = tmp_path_factory.mktemp("report")
    corpus = write_corpus(root / "data" / "corpus.parquet")
    overrides = tiny_overrides(corpus, root / "jobs", "reported", training__steps=STEPS, checkpoint__interval=0,
                               logging__eval_interval=4,
                               data__sources=json.dumps([{"path": str(corpus), "validation_fraction": 0.1}]))
    cfg = load_config(None, overrides, environ={})
    write_job_dir(cfg)
    Trainer(cfg, cfg.job_dir).train()
    return cfg.job_dir


def copy_job(job, dest, last_step: int):
    """The job as it looked while training: config and metrics up to `last_step`, then half of the next line
    (no COMPLETED marker, no checkpoint)."""
    dest.mkdir()
    shutil.copy(job / "config.json", dest / "config.json")
    lines = (job / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    following = next(line for line in lines if json.loads(line)["step"] == last_step + 1)
    (dest / "metrics.jsonl").write_text("".join(kept) + following[: len(following) // 2])
    return dest


def parse_summary(summary: str) -> dict[str, str]:
    """The summary's "  label<padding>  text" lines as {label: text}."""
    return {label: text.strip() for _, label, text in (line.split("  ", 2) for line in summary.splitlines()[1:])}


def assert_dashboard(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        assert image.size == (1500, 800)
        colours = image.convert("L").getextrema()
    assert colours[0] < 80 and colours[1] == 255  # dark lines and text on white, not a blank page
    assert 20_000 < path.stat().st_size < 2_000_000


def test_report_of_a_finished_job(finished_job, capsys):
    main(["report", str(finished_job)])  # the command, in this process (torch is imported already)
    assert_dashboard(finished_job / "report.png")
    summary = (finished_job / "report.txt").read_text()
    png, txt = finished_job / "report.png", finished_job / "report.txt"
    assert capsys.readouterr().out == f"{summary}wrote {png} and {txt}\n"

    records = read_metrics(finished_job / "metrics.jsonl")
    last = records[-1]
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in vals] == [4, 8]
    best = min(vals, key=lambda r: r["val_loss"])
    lines = parse_summary(summary)
    assert lines["status"].startswith(f"completed at step {STEPS}, ")
    assert lines["steps"] == f"{STEPS} of {STEPS} (100%)"
    assert "remaining" not in lines
    window = records[-5:]
    mean = sum(r["loss"] for r in window) / len(window)
    assert lines["loss"] == f"{last['loss']:.4f} at step {STEPS}; mean {mean:.4f} over steps 4-8"
    assert lines["validation loss"].startswith(f"last {vals[-1]['val_loss']:.4f} (ppl ")
    assert lines["validation loss"].endswith(", the best" if best is vals[-1] else
                                             f"; best {best['val_loss']:.4f} (ppl {math.exp(best['val_loss']):,.2f}) "
                                             f"at step {best['step']}")
    assert lines["tokens seen"] == f"{last['tokens_seen']:,}" == f"{STEPS * 4 * 32:,}"
    assert lines["MFU"].startswith("not measured")
    assert lines["checkpoint"] == f"checkpoints/step-{STEPS}"
    assert lines["checkpoint saves"] == "1 written (0 in the background)"  # the last step's, its event line
    assert lines["save times"].startswith("loop blocked ") and "; write " in lines["save times"]
    assert "skipped steps" not in lines


def test_report_of_a_relative_job_path(finished_job, tmp_path, monkeypatch, capsys):
    """`maester report jobs/<name>` as the docs write it, from the directory above the jobs."""
    job = tmp_path / "jobs" / "relative"
    shutil.copytree(finished_job, job)
    monkeypatch.chdir(tmp_path)
    main(["report", "jobs/relative"])
    assert parse_summary((job / "report.txt").read_text())["checkpoint"] == f"checkpoints/step-{STEPS}"
    assert "wrote jobs/relative/report.png" in capsys.readouterr().out


def test_report_of_a_running_job(finished_job, tmp_path):
    job = copy_job(finished_job, tmp_path / "running", last_step=5)
    records = read_metrics(job / "metrics.jsonl")
    assert records[-1]["step"] == 5  # the half line of step 6 is not read
    now = (job / "metrics.jsonl").stat().st_mtime + 150

    report = write_report(job, tmp_path / "elsewhere" / "dash.png", now=now)
    assert report.png == tmp_path / "elsewhere" / "dash.png" and report.text == tmp_path / "elsewhere" / "dash.txt"
    assert_dashboard(report.png)
    assert report.text.read_text() == report.summary + "\n"
    assert not (job / "report.png").exists()

    # The pace: each logged step covers the tokens since the one before at its own tokens/s (steps 2-5).
    seconds = sum((b["tokens_seen"] - a["tokens_seen"]) / b["tokens_per_second"]
                  for a, b in zip(records[:4], records[1:5]))
    pace = seconds / 4
    lines = parse_summary(report.summary)
    assert lines["status"] == "in progress or interrupted: last logged step 5, 2 min ago"
    assert lines["steps"] == f"5 of {STEPS} (62%)"
    assert lines["remaining"].startswith("3 steps, about ") and f" at {pace:.3g} s/step (steps 2-5)" in \
        lines["remaining"]
    assert lines["loss"].startswith(f"{records[-1]['loss']:.4f} at step 5; mean ")
    val = records[3]
    assert lines["validation loss"] == \
        f"last {val['val_loss']:.4f} (ppl {math.exp(val['val_loss']):,.2f}) at step 4, the best"
    assert lines["checkpoint"] == "none yet"


def test_report_of_a_job_stopped_for_requeue_after_a_nonfinite_step(finished_job, tmp_path):
    job = copy_job(finished_job, tmp_path / "requeued", last_step=6)
    # As a `skip` run logs it: the non-finite loss is stored as null and the step counted.
    lines = (job / "metrics.jsonl").read_text().split("\n")
    for i, line in enumerate(lines[:-1]):
        record = json.loads(line)
        if "loss" in record:
            record["skipped_steps"] = int(record["step"] >= 6)
            if record["step"] == 6:
                record["loss"] = None
        lines[i] = json.dumps(record)
    (job / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    write_marker(job / REQUEUE_FILE, {"step": 6, "reason": "SIGTERM", "checkpoint": "step-6"})
    finite_5 = read_metrics(job / "metrics.jsonl")[4]

    report = write_report(job)
    assert_dashboard(job / "report.png")
    lines = parse_summary(report.summary)
    assert lines["status"].startswith("stopped for requeue at step 6 (SIGTERM), ")
    assert lines["steps"] == f"6 of {STEPS} (75%)"
    window = [r["loss"] for r in read_metrics(job / "metrics.jsonl")[1:6] if r["loss"] is not None]
    assert lines["loss"] == f"non-finite at step 6; last finite {finite_5['loss']:.4f} at step 5; mean " \
                            f"{sum(window) / 4:.4f} over the 4 finite of steps 2-6"
    assert lines["skipped steps"] == "1 (non-finite loss or gradients)"


def test_report_of_a_job_without_metrics(finished_job, tmp_path, capsys):
    job = tmp_path / "fresh"
    job.mkdir()
    shutil.copy(finished_job / "config.json", job / "config.json")
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(job)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"maester report: error: {job / 'metrics.jsonl'} does not exist: the job has " \
                                      f"logged no step yet\n"
    assert not (job / "report.png").exists()

    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nothing' / 'config.json'} does not exist"):
        write_report(tmp_path / "nothing")
    (job / "metrics.jsonl").write_text('{"step": 1, "lo')  # the first line, half written
    with pytest.raises(ValueError, match="holds no logged training step yet"):
        write_report(job)


def test_a_job_from_before_events_jsonl_resumes_and_reports_both(finished_job, tmp_path, capsys):
    """A job whose events sit between the rows of metrics.jsonl (as maester wrote them before events.jsonl): a
    resume appends its rows and events to the two files, and `report` and `status` read the events of both."""
    job = tmp_path / "jobs" / "reported"
    shutil.copytree(finished_job, job, symlinks=True)
    rows = (job / "metrics.jsonl").read_text().splitlines(keepends=True)
    events = (job / "events.jsonl").read_text().splitlines(keepends=True)
    (job / "metrics.jsonl").write_text("".join(rows[:2] + events + rows[2:]))  # the old, mixed file
    (job / "events.jsonl").unlink()
    assert main(["train", str(job), f"--training.steps={STEPS + 2}"]) in (0, None)
    assert [r["step"] for r in read_metrics(job / "metrics.jsonl")] == list(range(1, STEPS + 3))
    assert all(r["loss"] is not None for r in read_metrics(job / "metrics.jsonl"))
    kinds = [(e["event"], e["step"]) for e in read_events(job)]
    assert kinds[:len(events)] == [(json.loads(e)["event"], json.loads(e)["step"]) for e in events]
    assert ("load", STEPS) in kinds[len(events):] and ("checkpoint", STEPS + 2) in kinds[len(events):]
    main(["report", str(job)])
    assert parse_summary((job / "report.txt").read_text())["checkpoint saves"] == "2 written (0 in the background)"
    capsys.readouterr()
    main(["status", str(job)])
    out = capsys.readouterr().out
    assert "10 of 10 (100%)" in out, out
