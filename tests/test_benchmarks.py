"""The benchmark harnesses run (in their CPU smoke mode) and print their table."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO, clean_env


def test_train_throughput_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--smoke"],
                         env=clean_env(XDG_CACHE_HOME=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = out.stdout.strip().splitlines()[-1].split("|")
    assert row[1].strip() == "smoke (CPU, tiny)"
    assert int(row[3]) == 3 and float(row[4].replace(",", "")) > 0
    assert row[5].strip() == "n/a"  # no MFU on CPU
