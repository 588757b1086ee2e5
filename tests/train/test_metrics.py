"""MFU arithmetic against a hand count, the peak-FLOPs table, and metrics.jsonl reading/writing."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from maester.config import ModelConfig
from maester.models.build import build_on_meta, count_parameters, resolve_args
from maester.train.metrics_file import check_event, check_row, read_events, schema_markdown
from maester.train.metrics import (PEAK_FLOPS, MetricsWriter, device_peak_flops, flops_per_token,
                                   matmul_parameters, model_flops_per_token, peak_flops, read_metrics)

from tests.helpers import REPO


def meta_model(**overrides):
    cfg = ModelConfig(flavor="tiny", overrides=overrides)
    return build_on_meta(cfg, resolve_args(cfg, 269))


def hand_count(d: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int) -> dict:
    """Every parameter of a Llama, written out."""
    q = d * (heads * head_dim)
    k = d * (kv_heads * head_dim)
    v = d * (kv_heads * head_dim)
    o = (heads * head_dim) * d
    mlp = 3 * d * ffn  # gate, up, down
    norms = 2 * d  # attention_norm, ffn_norm
    per_layer = q + k + v + o + mlp + norms
    body = layers * per_layer + d  # + final norm
    return {"body": body, "embedding": vocab * d, "head": vocab * d}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matmul_parameters_and_flops_match_a_hand_count(tied):
    model = meta_model(tie_embeddings=tied)
    # The tiny flavor: dim 64, 2 layers, 4 heads, 2 KV heads (head_dim 16), ffn 192; vocab 269 -> 320.
    d, layers, heads, kv, hd, ffn, vocab = 64, 2, 4, 2, 16, 192, 320
    a = model.args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.resolved_head_dim, a.ffn_hidden_dim, a.vocab_size) == \
        (d, layers, heads, kv, hd, ffn, vocab)

    # Per layer: q 64*64 = 4096, k 64*2*16 = 2048, v 2048, o 4096, mlp 3*64*192 = 36864, norms 128.
    per_layer = 4096 + 2048 + 2048 + 4096 + 36864 + 128
    assert per_layer == 49280
    body = 2 * per_layer + 64  # final norm
    assert body == 98624
    embedding = head = 320 * 64  # 20480
    assert hand_count(d, layers, heads, kv, hd, ffn, vocab) == {"body": body, "embedding": embedding, "head": head}

    if tied:
        # One matrix, used as the output head: it is counted (once).
        assert count_parameters(model) == body + embedding == 119104
        n = body + embedding
    else:
        # The input embedding is a lookup, not a matmul: excluded; the separate head is counted.
        assert count_parameters(model) == body + embedding + head == 139584
        n = body + head
    assert matmul_parameters(model) == n == 119104

    seq_len = 128
    attention = 12 * layers * heads * hd * seq_len  # 12 * 2 * 4 * 16 * 128
    assert attention == 196608
    assert model_flops_per_token(model, seq_len) == 6 * n + attention == 6 * 119104 + 196608 == 911232
    assert flops_per_token(n, layers, heads, hd, seq_len) == 911232
    # Attention FLOPs grow with the sequence length, linearly.
    assert model_flops_per_token(model, 256) - model_flops_per_token(model, 128) == attention


def test_flops_use_the_head_dim_not_dim_over_heads():
    # An explicit head_dim of 32 with 4 heads: attention width 128, twice the model width of 64.
    model = meta_model(head_dim=32, n_layers=3, tie_embeddings=False)
    d, layers, heads, kv, hd, ffn, vocab = 64, 3, 4, 2, 32, 192, 320
    counts = hand_count(d, layers, heads, kv, hd, ffn, vocab)
    # Per layer: q 64*128 = 8192, k 64*64 = 4096, v 4096, o 128*64 = 8192, mlp 36864, norms 128 -> 61568.
    assert counts["body"] == 3 * (8192 + 4096 + 4096 + 8192 + 36864 + 128) + 64 == 184768
    n = counts["body"] + counts["head"]
    assert matmul_parameters(model) == n == 184768 + 20480
    assert model_flops_per_token(model, 100) == 6 * n + 12 * 3 * 4 * 32 * 100


def test_matmul_parameters_of_a_real_flavor():
    # Llama 3.1 8B (untied): all parameters but the 128256 x 4096 input embedding.
    cfg = ModelConfig(flavor="8B")
    model = build_on_meta(cfg, resolve_args(cfg, 128256))
    assert matmul_parameters(model) == 8_030_261_248 - 128256 * 4096
    # Llama 3.2 1B (tied): the shared matrix is the head, so everything counts.
    cfg = ModelConfig(flavor="1B")
    model = build_on_meta(cfg, resolve_args(cfg, 128256))
    assert matmul_parameters(model) == 1_235_814_400


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA B200", 2250e12),
    ("NVIDIA GB200", 2500e12),
    ("NVIDIA B300 SXM6 AC", 2250e12),
    ("NVIDIA GB300", 2500e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("AMD Instinct MI210", 181e12),
    ("AMD Instinct MI250X", 191.5e12),
    ("AMD Instinct MI250X/MI250", 191.5e12),
    ("AMD Instinct MI250X / MI250", 191.5e12),
    ("AMD Instinct MI250", 181e12),
    ("AMD Instinct MI300A", 980.6e12),
    ("AMD Instinct MI300X", 1307.4e12),
    ("AMD Instinct MI325X", 1307.4e12),
    ("AMD Instinct MI355X", 2500e12),
    ("NVIDIA GeForce RTX 4090", None),
    ("Tesla V100-SXM2-32GB", None),
    ("", None),
])
def test_peak_flops_table(name, expected):
    assert peak_flops(name) == expected


@pytest.mark.parametrize("name, arch, expected", [
    ("", "gfx90a:sramecc+:xnack-", 191.5e12),
    ("", "gfx942", 1307.4e12),
    ("AMD Radeon Graphics", "gfx942:sramecc+:xnack-", 1307.4e12),
    ("AMD Instinct MI300A", "gfx942", 980.6e12),  # a known name wins over the architecture
    ("", "gfx1100", None),
    ("", "", None),
])
def test_peak_flops_falls_back_to_the_rocm_architecture(name, arch, expected):
    assert peak_flops(name, arch) == expected


def test_no_mfu_on_the_cpu_says_so(caplog):
    """docs/observability.md promises a warning where mfu is null."""
    with caplog.at_level(logging.WARNING, logger="maester"):
        assert device_peak_flops(torch.device("cpu")) is None
    assert "MFU is not reported on cpu: there is no peak-FLOPs figure for it" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_peak_is_read_from_its_name_and_architecture():
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    expected = peak_flops(torch.cuda.get_device_name(device), getattr(props, "gcnArchName", "") or "")
    assert device_peak_flops(device) == expected
    assert device_peak_flops(torch.device("cpu")) is None


def test_peak_flops_keys_are_unique():
    keys = [key for key, _ in PEAK_FLOPS]
    assert len(keys) == len(set(keys))


# ---------------------------------------------------------------- metrics.jsonl


def record(step: int, loss: float = 1.0) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_second": 1234.0,
            "mfu": None, "data_loading_seconds": 0.01, "peak_memory_gib": 0.1}


def test_read_metrics_keeps_the_last_record_per_step_and_tolerates_a_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [record(1, 5.0), record(2, 4.0), record(3, 3.0),  # first run, killed after step 3
             record(2, 4.5), record(3, 3.5), record(4, 2.0)]  # resumed from the step-1 checkpoint
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "loss": 1.'  # being written now
    path.write_text(text)
    got = read_metrics(path)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == [5.0, 4.5, 3.5, 2.0]
    # Blank lines are fine; a bad line that is not the last is an error naming file and line.
    path.write_text(json.dumps(record(1)) + "\n\n" + "{oops\n" + json.dumps(record(2)) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not valid JSON")):
        read_metrics(path)
    path.write_text(json.dumps(record(2)) + "\n\n" + json.dumps(record(1)) + "\n")
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_read_metrics_merges_eval_lines_and_drops_those_a_restart_logged_over(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [record(1, 5.0), record(2, 4.0), {"step": 2, "val_loss": 4.2},  # killed after step 2's eval
             record(2, 4.5), record(3, 3.5), {"step": 3, "val_loss": 3.7}]  # resumed from step 1, eval at 3
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = {r["step"]: r for r in read_metrics(path)}
    assert "val_loss" not in got[2] and got[2]["loss"] == 4.5
    assert got[3]["val_loss"] == 3.7 and got[3]["loss"] == 3.5


class ListHandler(logging.Handler):
    """Collects messages on the "maester" logger itself (it may not propagate once the trainer set it up)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, rec: logging.LogRecord) -> None:
        self.messages.append(rec.getMessage())


def test_metrics_writer_drops_a_partial_trailing_line_before_appending(tmp_path):
    path = tmp_path / "job" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(record(1)) + "\n" + json.dumps(record(2)) + "\n" + '{"step": 3, "loss": 0.')
    writer = MetricsWriter(path.parent)
    # The partial line is gone as soon as the writer opens the file.
    assert path.read_text() == json.dumps(record(1)) + "\n" + json.dumps(record(2)) + "\n"
    logger, handler = logging.getLogger("maester"), ListHandler()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        writer.write(record(3, loss=float("nan")))
        writer.write(record(4, loss=0.25))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    writer.close()
    lines = path.read_text().split("\n")
    assert lines[-1] == ""
    parsed = [json.loads(line) for line in lines[:-1]]  # every line is valid (strict) JSON
    assert [r["step"] for r in parsed] == [1, 2, 3, 4]
    assert parsed[2]["loss"] is None  # a non-finite float is written as null, not NaN
    assert parsed[3]["loss"] == 0.25
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert any("step 4" in m and "loss 0.2500" in m for m in handler.messages)  # and a console line


def test_metrics_writer_on_a_lone_partial_line_and_a_new_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "lo')
    (tmp_path / "events.jsonl").write_text('{"event": "stop", "st')
    MetricsWriter(tmp_path).close()
    assert path.read_text() == "" and (tmp_path / "events.jsonl").read_text() == ""
    fresh = tmp_path / "new" / "dir" / "metrics.jsonl"
    writer = MetricsWriter(fresh.parent)
    writer.write(record(7))
    writer.close()
    assert [r["step"] for r in read_metrics(fresh)] == [7]
    # A complete file is left as it is.
    before = fresh.read_text()
    MetricsWriter(fresh.parent).close()
    assert fresh.read_text() == before


def test_a_step_is_one_row_with_its_evaluations_and_events_have_their_own_file(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(record(2))
    writer.write_event({"event": "stop", "step": 2, "reason": "SIGTERM", "checkpoint": "step-2", "time": "now"})
    writer.write_eval({"step": 2, "val_loss": 4.2, "val_perplexity": 66.7})
    writer.write_downstream({"step": 2, "eval/pydoc_choice/acc": 0.5, "eval/seconds": 1.0})
    writer.end_step()
    writer.write(record(3))
    with pytest.raises(ValueError, match="step 4's evaluation has no training row"):
        writer.write_eval({"step": 4, "val_loss": 1.0})
    writer.close()  # writes step 3's row
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in rows} == {2: 1.0, 3: 1.0}  # a table: every row has its loss
    assert rows[0]["val_loss"] == 4.2 and rows[0]["eval/pydoc_choice/acc"] == 0.5
    assert [e["event"] for e in read_events(tmp_path)] == ["stop"]


def test_events_of_an_older_job_in_metrics_jsonl_are_read_first(tmp_path):
    """A job written before events.jsonl kept its events between the rows: read_metrics skips them, read_events
    takes them before the new file's."""
    old = [record(1), {"event": "checkpoint", "step": 1, "checkpoint": "step-1", "background": False,
                       "checkpoint_blocked_seconds": 0.1}, record(2), {"step": 2, "val_loss": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    writer = MetricsWriter(tmp_path)
    writer.write(record(3))
    writer.write_event({"event": "load", "step": 2, "checkpoint": "step-1", "mode": "continue"})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert [(e["event"], e["step"]) for e in read_events(tmp_path)] == [("checkpoint", 1), ("load", 2)]


def test_the_schema_refuses_what_it_does_not_document(tmp_path, monkeypatch):
    assert check_row(record(1)) == [] and check_row({"step": 1, "lr/decay": 0.1, "eval/x/acc": None}) == []
    assert check_row({"step": 1, "losss": 1.0}) == ["'losss' is not a documented field"]
    assert check_row({"step": 1, "loss": "low"}) == ["loss = 'low' is not a number or null"]
    assert check_row({"event": "stop", "step": 1})[0].startswith("a row needs")
    assert check_event({"event": "stop", "step": 1, "reason": "x", "checkpoint": "step-1", "time": "t"}) == []
    assert check_event({"event": "stop", "step": 1, "reason": "x", "time": "t"}) == ["stop: 'checkpoint' is missing"]
    assert check_event({"event": "nap", "step": 1})[0].startswith("event 'nap' is not one of")
    monkeypatch.setenv("_MAESTER_CHECK_RECORDS", "1")
    writer = MetricsWriter(tmp_path)
    with pytest.raises(ValueError, match="not a documented field"):
        writer.write_event({"event": "load", "step": 1, "checkpoint": "c", "mode": "continue", "extra": 1})
    writer.write({**record(1), "losss": 2.0})
    with pytest.raises(ValueError, match="'losss' is not a documented field"):
        writer.close()


def test_docs_show_the_schema():
    """docs/observability.md holds `schema_markdown()` between its markers, so the page cannot drift."""
    page = (REPO / "docs" / "observability.md").read_text()
    begin, end = "<!-- schema: generated by maester.train.metrics_file.schema_markdown -->", "<!-- schema end -->"
    assert page[page.index(begin) + len(begin):page.index(end)].strip() == schema_markdown().strip()
