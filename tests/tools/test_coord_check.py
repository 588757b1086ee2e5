"""The μP coordinate check: flat in width with μP (AdamW and Muon), growing without it; its CLI writes CSV + PNG."""

from __future__ import annotations

import csv

import pytest

from maester.config import load_config
from maester.tools.coord_check import MODULES, coord_check, spread
from tests.helpers import REPO, run_maester

CONFIG = REPO / "configs" / "mup" / "coord-check.toml"
WIDTHS = [64, 128, 256]
STEPS = 3


def spreads(*overrides: str) -> dict[str, float]:
    cfg = load_config(CONFIG, ["--data.seq_len=32", "--training.global_batch_size=4",
                               "--training.micro_batch_size=4", *overrides], environ={})
    return spread(coord_check(cfg, WIDTHS, steps=STEPS), STEPS)


@pytest.mark.parametrize("optimizer", [
    ["--optimizer.name=adamw"],
    ["--optimizer.name=muon", "--optimizer.muon.lr=0.05"],
])
def test_mup_keeps_activations_flat_and_standard_parametrization_does_not(optimizer):
    mup = spreads(*optimizer)
    assert all(mup[m] < 2.0 for m in MODULES), mup
    sp = spreads(*optimizer, "--mup.enabled=false")
    # without μP the hidden activations grow with width: by far more than 2x over a 4x wider model
    assert sp["attention"] > 3.0 and sp["mlp"] > 3.0, sp
    assert max(sp.values()) > 2.5 * max(mup.values())


def test_cli_writes_csv_and_png(tmp_path):
    out = tmp_path / "cc"
    result = run_maester(["mup", "coord-check", str(CONFIG), "--widths", "64,128", "--steps", "2", "--out", str(out),
                          "--data.seq_len=32", "--training.global_batch_size=2", "--training.micro_batch_size=2"],
                         tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "largest / smallest mean |activation| across widths 64..128 at step 2: embedding" in result.stdout
    rows = list(csv.DictReader(open(out / "coord_check.csv")))
    assert {(int(r["width"]), int(r["step"]), r["module"]) for r in rows} == {
        (w, s, m) for w in (64, 128) for s in (1, 2) for m in MODULES}
    assert (out / "coord_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bad = run_maester(["mup", "coord-check", str(CONFIG), "--widths", "128,64"], tmp_path)
    assert bad.returncode == 2 and "--widths must be at least two increasing widths" in bad.stderr
