"""Acceptance: the seed's marker JSONL tokenized once with `maester data tokenize --template markers` trains 20
steps with the same losses, bit for bit, as training from the JSONL itself (the same conversations, labels and
packing), and a conversation longer than `data.seq_len` is truncated in both."""

from __future__ import annotations

import json

from maester.cli import main
from maester.config import load_config
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.data.test_sft_indexed import MARKERS, write_marker_jsonl
from tests.helpers import tiny_overrides


def sft_run(path: str, tmp_path, name: str) -> list[dict]:
    values = dict(data__mode="sft", data__seq_len=128, data__sft__template="markers",
                  data__sources=json.dumps([{"path": path, "name": "seed", "validation_fraction": 0.1}]),
                  tokenizer__control_tokens=json.dumps(MARKERS), training__steps=20, logging__eval_interval=20,
                  training__global_batch_size=2, training__micro_batch_size=2,
                  checkpoint__interval=0, schedule__name="constant", schedule__warmup_steps=0)
    cfg = load_config(None, tiny_overrides(tmp_path, tmp_path / "jobs", name, **values), environ={})
    Trainer(cfg, cfg.job_dir).train()
    return read_metrics(cfg.job_dir / "metrics.jsonl")


def test_tokenized_seed_jsonl_trains_like_the_jsonl(tmp_path):
    seed = tmp_path / "seed.jsonl"
    write_marker_jsonl(seed, 60, long_every=13)
    markers = [f"{m}={t}" for m, t in MARKERS.items()]
    main(["data", "tokenize", str(seed), "--output-prefix", str(tmp_path / "seed"), "--tokenizer", "byte",
          "--control-tokens", *markers, "--template", "markers"])
    direct = sft_run(str(seed), tmp_path, "jsonl")
    indexed = sft_run(str(tmp_path / "seed_text_document"), tmp_path, "indexed")
    assert [r["step"] for r in indexed if "loss" in r] == list(range(1, 21))
    assert [(r["step"], r["loss"]) for r in indexed if "loss" in r] == [(r["step"], r["loss"]) for r in direct
                                                                       if "loss" in r]
    assert [r["val_loss"] for r in indexed if "val_loss" in r] == [r["val_loss"] for r in direct if "val_loss" in r]
    assert indexed[-1]["data/seed/truncated"] == direct[-1]["data/seed/truncated"] > 0
    assert indexed[-1]["data/seed/kept"] == 60
