"""The closing line of a run with the combination matrix; `tests/conftest.py` calls it, since the controller of a
run in parallel (pytest-xdist) loads only the top conftest."""

from __future__ import annotations


def matrix_summary(terminalreporter) -> None:
    """The matrix's closing line: pairs, cells, seconds (from the tests' recorded properties)."""
    runs = [dict(r.user_properties) for r in terminalreporter.stats.get("passed", []) +
            terminalreporter.stats.get("failed", []) if any(k == "matrix_cells" for k, _ in r.user_properties)]
    if not runs:
        return
    cells = sum(r["matrix_cells"] for r in runs)
    refused = sum(r.get("matrix_refused", 0) for r in runs)
    pairs = {tuple(map(tuple, pair)) for r in runs for pair in r.get("matrix_pairs", [])}
    wall = max(r["matrix_end"] for r in runs) - min(r["matrix_start"] for r in runs)
    busy = sum(r["matrix_end"] - r["matrix_start"] for r in runs)
    cpu = sum(r.get("matrix_cpu", 0) for r in runs)
    terminalreporter.write_line(f"combination matrix: {len(pairs)} pairs covered by {cells} cells that trained, "
                                f"{refused} refused; {wall:.0f} s of wall time ({busy:.0f} s summed over the "
                                f"tests, {cpu:.0f} CPU seconds)")
