"""A damaged trainer_state.json is an error that names the file (exit 2), not a bare JSON message."""

from __future__ import annotations

from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, write_corpus


def test_garbage_trainer_state_names_the_file(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    args = tiny_overrides(corpus, tmp_path / "jobs", "x", training__steps=4, checkpoint__interval=2)
    first = run_maester(["train", str(DEMO_CONFIG), *args], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    state = tmp_path / "jobs" / "x" / "checkpoints" / "step-4" / "trainer_state.json"
    state.write_text("garbage")
    again = run_maester(["train", str(tmp_path / "jobs" / "x"), "--training.steps=6"], cwd=tmp_path)
    assert again.returncode == 2, again.stderr[-2000:]
    assert f"{state}: not valid JSON" in again.stderr and "Traceback" not in again.stderr
