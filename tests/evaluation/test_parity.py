"""`maester eval` on a job equals lm-eval's own `HFLM` on the job's `convert to-hf` export: every request's
log-likelihood, accuracy and acc_norm, and the greedy text of generation; loglikelihood_rolling over windows of the
model's context too."""

from __future__ import annotations

import json

import pytest
import torch

from tests.evaluation.conftest import LIMIT, OFFLINE, TASKS, run_eval


def by_doc(samples: list[dict]) -> dict[int, dict]:
    return {s["doc_id"]: s for s in samples}


def hflm_results(hf_dir, tasks: str):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from maester.evaluation.task_specs import SHIPPED_TASKS

    lm = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=3, dtype="float32")
    manager = TaskManager(include_path=str(SHIPPED_TASKS), include_defaults=False)
    return lm, simple_evaluate(model=lm, tasks=tasks.split(","), task_manager=manager, limit=int(LIMIT),
                               log_samples=True)


def assert_same_responses(ours: dict, theirs: dict, task: str) -> int:
    """Every document's responses agree; returns how many generated texts are not empty."""
    mine, other = by_doc(ours["samples"][task]), by_doc(theirs["samples"][task])
    assert sorted(mine) == sorted(other) == list(range(int(LIMIT)))
    texts = 0
    for doc_id, sample in mine.items():
        a, b = [r[0] for r in sample["resps"]], [r[0] for r in other[doc_id]["resps"]]
        if isinstance(b[0], str):  # generate_until: the same text
            assert a == b, doc_id
            texts += sum(bool(t) for t in a)
        else:  # loglikelihood: (log-probability, is greedy) of each choice
            assert [x[0] for x in a] == pytest.approx([x[0] for x in b], rel=1e-4), doc_id
            assert [bool(x[1]) for x in a] == [bool(x[1]) for x in b], doc_id
    for key, value in theirs["results"][task].items():
        if key.endswith(",none") and "stderr" not in key:
            assert ours["results"][task][key] == pytest.approx(float(value), abs=1e-12), (task, key)
    return texts


def test_maester_eval_equals_hflm_on_the_export(eval_job, one_process_eval, tmp_path, monkeypatch):
    from maester.tools.convert import to_hf

    for name, value in {**OFFLINE, "HF_HOME": str(tmp_path / "hf-home")}.items():
        monkeypatch.setenv(name, value)
    job, seed = eval_job
    ours, printed = one_process_eval
    assert "|    Tasks     |Version|Filter|n-shot|  Metric   |" in printed  # lm-eval's own table
    assert "|pydoc_choice  |" in printed and "|exact_match|" in printed
    lm, theirs = hflm_results(to_hf(job, tmp_path / "hf-job"), TASKS)
    assert set(ours["results"]) == {"pydoc_choice", "pydoc_complete"}
    for task in ("pydoc_choice", "pydoc_complete"):
        assert_same_responses(ours, theirs, task)
    assert_same_rolling(job, lm)

    # The seed's random weights: greedy decoding writes varied bytes (invalid UTF-8 and all) before a stop string.
    run_eval([seed, "--tasks", "pydoc_complete", "--limit", LIMIT, "--output", tmp_path / "seed.json",
              "--log-samples"], tmp_path)
    _, theirs = hflm_results(to_hf(seed, tmp_path / "hf-seed"), "pydoc_complete")
    assert assert_same_responses(json.loads((tmp_path / "seed.json").read_text()), theirs, "pydoc_complete") >= 6


def assert_same_rolling(job, hflm) -> None:
    """Whole-text log-likelihoods of texts longer than the 64-token context (several windows each)."""
    from lm_eval.api.instance import Instance

    from maester.evaluation.harness_lm import MaesterLM
    from maester.tools.generate import load_for_inference

    model, tokenizer, cfg = load_for_inference(job, torch.device("cpu"))
    ours = MaesterLM(model, tokenizer, device=torch.device("cpu"), batch_size=2, add_bos=cfg.data.add_bos)
    texts = ["the model reads a token " * 9, "x", "predicts the next one while the optimizer updates " * 3]
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    mine, theirs = ours.loglikelihood_rolling(requests), hflm.loglikelihood_rolling(requests)
    assert mine == pytest.approx(theirs, rel=1e-4)
    assert len(ours.tok_encode(texts[0])) > 3 * ours.max_length
