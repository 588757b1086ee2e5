"""The job directory runs under torchrun as it does under `maester train`."""

from __future__ import annotations

from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, torchrun


def test_submit_then_torchrun_trains_the_job(corpus, tmp_path):
    submit = run_maester(["submit", "--no-submit", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "tr",
                                                                      training__steps=3)], tmp_path)
    assert submit.returncode == 0, submit.stderr
    job = tmp_path / "jobs" / "tr"
    run = torchrun(1, ["train", str(job)], tmp_path)
    assert run.returncode == 0, run.stderr
    assert (job / "checkpoints" / "step-3" / ".metadata").is_file()


def test_impossible_layout_fails_before_any_work(corpus, tmp_path):
    run_maester(["submit", "--no-submit", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "bad",
                                                             parallel__tp=3)], tmp_path)
    run = torchrun(2, ["train", str(tmp_path / "jobs" / "bad")], tmp_path)
    assert run.returncode != 0
    assert "does not divide the 2 process(es)" in run.stderr
    assert not (tmp_path / "jobs" / "bad" / "metrics.jsonl").exists()
