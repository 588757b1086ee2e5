"""One tiny job trained once and shared by the evaluation tests, with `maester eval` run on it once in this
process (a job, then a checkpoint: its randomly initialised seed, whose greedy text varies more)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tests.helpers import train_seeded_reference

TASKS = "pydoc_choice,pydoc_complete"
LIMIT = "12"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="session")
def eval_job(tmp_path_factory):
    """(the trained job, its seed checkpoint step-0): the tiny Llama with a 64-token context, so that long requests
    are cut from the left."""
    root = tmp_path_factory.mktemp("eval-job")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
        _, seeds, job = train_seeded_reference(root, **{"model.overrides": '{"max_seq_len": 64}'})
    return job, seeds / "step-0"


def run_eval(args: list[str], root) -> str:
    """`maester eval ARGS` in this process, offline, with the Hugging Face caches under `root`; its stdout."""
    from maester.cli import main

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        for name, value in {**OFFLINE, "HF_HOME": str(root / "hf-home")}.items():
            mp.setenv(name, value)
        main(["eval", *map(str, args)])
    return out.getvalue()


@pytest.fixture(scope="session")
def one_process_eval(eval_job, tmp_path_factory):
    """`maester eval JOB --tasks pydoc_choice,pydoc_complete --log-samples` on one process: (its JSON, its stdout)."""
    root = tmp_path_factory.mktemp("eval-one")
    printed = run_eval([eval_job[0], "--tasks", TASKS, "--limit", LIMIT, "--batch-size", "5", "--output",
                        root / "results.json", "--log-samples"], root)
    return json.loads((root / "results.json").read_text()), printed
