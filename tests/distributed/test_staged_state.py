"""The host copy a background save stages (DCP's stager, as `checkpoint.async_mode = "async"` uses it) holds the
live state bit for bit for every kind of tensor the trainer keeps, on 2 gloo ranks: FSDP2 with torchao's float8
weights (wrapper subclasses inside DTensors), tensor parallel, expert parallel, Muon's state under FSDP2; and a
background save keeps the fp16 loss scaler of its step while the live one changes; and `staged_bytes` (the host
memory of background saves) is what the stager takes, before the first step too (`staged_state.py`)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, torchrun, write_corpus

pytest.importorskip("torchao", reason="the float8 extra (torchao) is part of the dev group")


def test_staged_state_equals_the_live_state_in_every_layout(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    out = torchrun(2, [str(tmp_path), str(corpus)], tmp_path, timeout=600,
                   script=REPO / "tests/distributed/staged_state.py")
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert all(layout["compared"] > 40 for layout in report.values()), report
        assert "DTensor[dp_shard] of WeightWithDynamicFloat8CastTensor" in report["fsdp_float8"]["kinds"]
        assert "DTensor[tp] of Tensor" in report["tp"]["kinds"]
        assert "DTensor[dp_shard_mod_ep,ep] of Tensor" in report["ep"]["kinds"]
        assert "momentum_buffer" in report["fsdp_muon_fp16"]["optimizer_keys"]
        assert report["fsdp_muon_fp16"]["grad_scaler"] == {"scale": 65536.0, "growth_tracker": 1}
        for layout in report.values():  # the host memory of background saves, as the stager takes it
            size = layout["staged_bytes"]
            # the stager also deep-copies each DTensor's DeviceMesh, with its tensor of ranks: a few bytes a mesh
            assert 0 <= size["stager"] - size["now"] <= 64, size
            # before step 1: every moment and momentum counted, the step counters (4 bytes a parameter) not yet
            assert 0 <= size["stager"] - size["before_step_1"] <= 64 * size["parameters"], size
