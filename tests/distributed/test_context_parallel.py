"""Context parallel (parallel.cp) computes the same training run as one process: real torchrun processes on CPU
with gloo, each job from a fresh init (sharded CPU init copies one process's), losses compared step by step.

One reference run per kind of data (plain pretraining, pretraining with document masks, packed SFT with
validation), shared by the layouts that use it; the cp2 x fsdp2 job's step-3 checkpoint also resumes on one
process. Five launches: about 180 s of CPU time in all.
"""

from __future__ import annotations

import json

import pytest

from maester.config import load_config
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.data.test_sft import write_conversations
from tests.helpers import DEMO_CONFIG, tiny_overrides, torchrun, write_corpus

STEPS = 5
BASE = dict(training__steps=STEPS, training__global_batch_size=8, training__micro_batch_size=2,
            checkpoint__interval=0, checkpoint__save_final="false", schedule__warmup_steps=1, data__seq_len=64)
DATA = {
    "plain": {},
    "documents": {"data__document_masking": "true"},
    "sft": {"data__mode": "sft", "data__seq_len": 256, "logging__eval_interval": STEPS,
            "training__global_batch_size": 4},
}
LAYOUTS = {  # name: (processes, data, overrides)
    "cp2": (2, "plain", {"parallel__cp": 2}),
    "cp2_sft": (2, "sft", {"parallel__cp": 2}),
    "cp2_fsdp2": (4, "plain", {"parallel__cp": 2, "checkpoint__interval": 3}),
    "cp2_fsdp2_documents": (4, "documents", {"parallel__cp": 2}),
    "cp2_tp2_documents": (4, "documents", {"parallel__cp": 2, "parallel__tp": 2}),
}


def overrides(root, data: str, name: str, **extra) -> list[str]:
    values = {**BASE, **DATA[data], **extra}
    if data == "sft":
        values["data__sources"] = json.dumps([{"path": str(root / "data" / "chats.jsonl"),
                                               "validation_fraction": 0.2}])
    return tiny_overrides(root / "data" / "corpus.parquet", root / "jobs", name, **values)


def records(job_dir) -> list[dict]:
    return read_metrics(job_dir / "metrics.jsonl")  # a step's training and evaluation records in one


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process per kind of data, in this process."""
    root = tmp_path_factory.mktemp("cp")
    write_corpus(root / "data" / "corpus.parquet")
    write_conversations(root / "data" / "chats.jsonl", 60)
    out = {}
    for data in DATA:
        cfg = load_config(DEMO_CONFIG, overrides(root, data, f"reference-{data}"), environ={})
        Trainer(cfg, cfg.job_dir).train()
        out[data] = records(cfg.job_dir)
    return root, out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_matches_one_process(references, layout):
    root, expected = references
    nproc, data, extra = LAYOUTS[layout]
    run = torchrun(nproc, ["train", str(DEMO_CONFIG), *overrides(root, data, layout, **extra)], root)
    assert run.returncode == 0, run.stderr[-4000:]
    got, want = records(root / "jobs" / layout), expected[data]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5), layout
    # The step's token and label counts are the whole step's, not one cp rank's.
    for key in ("label_tokens_per_step", "tokens_seen"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    if data == "sft":  # packed rows (more conversations than the 4 rows); validation sums over dp x cp too
        assert all(r["documents_per_step"] > 4 for r in got)
        assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=1e-5)
    if data == "documents":  # the masks change the run: CP cannot match it by ignoring them
        assert [r["loss"] for r in want] != pytest.approx([r["loss"] for r in expected["plain"]], rel=1e-4)
    if "checkpoint__interval" in extra:  # its step-3 checkpoint resumes on one process, on the same curve
        job = root / "jobs" / layout
        cfg = load_config(job / "config.json", ["--parallel.cp=1"], environ={})
        trainer = Trainer(cfg, job)
        assert trainer.step == 3
        trainer.train()
        assert [r["loss"] for r in records(job)] == pytest.approx([r["loss"] for r in want], rel=1e-5)
