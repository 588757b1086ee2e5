"""Sampling and plotting on real trained jobs, through the command line as a user runs them."""

from __future__ import annotations

import torch

from maester.config import load_config
from maester.tools.generate import load_for_inference, sample
from maester.train.trainer import Trainer
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides


def trained_job(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "gen", training__steps=6), environ={})
    Trainer(cfg, cfg.job_dir).train()
    return cfg.job_dir


def test_sampling_rules(corpus, tmp_path):
    model, tokenizer, cfg = load_for_inference(trained_job(corpus, tmp_path), torch.device("cpu"))
    prompt = tokenizer.encode("the model ")
    greedy = sample(model, prompt, 12)
    assert len(greedy) == 12 and greedy == sample(model, prompt, 12)
    # top-k 1 leaves only the argmax, whatever the temperature
    assert sample(model, prompt, 12, temperature=1.5, top_k=1, seed=3) == greedy
    a = sample(model, prompt, 12, temperature=1.0, seed=1)
    assert a == sample(model, prompt, 12, temperature=1.0, seed=1)
    assert all(0 <= t < model.args.vocab_size for t in a)
    # the loop stops at EOS: make the greedy first token the "EOS"
    assert sample(model, prompt, 12, eos_id=greedy[0]) == []


def test_generate_and_plot_commands(corpus, tmp_path):
    job = trained_job(corpus, tmp_path)
    out = run_maester(["generate", str(job), "--prompt", "the model", "--max-new-tokens", "16"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("the model") and len(out.stdout.strip()) > len("the model")

    plot = run_maester(["plot", str(job)], tmp_path)
    assert plot.returncode == 0, plot.stderr
    png = job / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    missing = run_maester(["generate", str(tmp_path / "nope"), "--prompt", "x"], tmp_path)
    assert missing.returncode == 2 and "no checkpoint" in missing.stderr


def test_demo_config_trains_on_the_builtin_corpus(tmp_path):
    """The Quick start's config, shortened: the built-in corpus is written, read, and the loss falls."""
    run = run_maester(["train", str(DEMO_CONFIG), f"--job.dump_dir={tmp_path / 'jobs'}", "--training.steps=16",
                       "--schedule.warmup_steps=4", "--logging.interval=8", "--checkpoint.interval=0",
                       "--data.seq_len=128"], tmp_path,
                      env=clean_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert run.returncode == 0, run.stderr
    assert list((tmp_path / "cache" / "maester" / "corpora").glob("pydoc-*.parquet"))
    from maester.train.metrics import read_metrics

    records = read_metrics(tmp_path / "jobs" / "demo" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 8, 16]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert records[0]["mfu"] is None  # CPU: no peak-FLOPs figure, so no MFU guess
