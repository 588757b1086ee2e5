"""The combination matrix (`cells.py` says what a cell does): by default a fixed, seeded slice of cells that covers
every pair of values of any two factors; with `pytest -m combinations`, the full matrix, which also covers every
triple of layout x precision x checkpoint. Every cell trains, resumes bit-identically and exports, or is refused
as the table says (`maester.combinations.REFUSALS`)."""

from __future__ import annotations

import functools
import itertools
import json
import time

import pytest

from maester.combinations import BEGIN, END, FACTORS, REFUSALS, accepted, page, refusals_of
from tests.combinations import export
from tests.combinations.cells import Cell, CellFailed, run_cell, run_refused
from tests.combinations.matrix import RISKY, cost, generate
from tests.helpers import REPO

GROUPS = 8  # tests of the default slice, so that pytest-xdist's workers share them out


@functools.cache
def matrix(full: bool) -> tuple[list[Cell], list[Cell]]:
    cells, refused = generate(full)
    return [Cell(v, i) for i, v in enumerate(cells)], [Cell(v, 500 + i) for i, v in enumerate(refused)]


def groups(cells: list[Cell], n: int) -> list[list[Cell]]:
    """`cells` dealt into `n` groups of about equal cost, largest first."""
    out: list[list[Cell]] = [[] for _ in range(n)]
    for cell in sorted(cells, key=lambda c: -cost(c.values)):
        min(out, key=lambda g: sum(cost(c.values) for c in g)).append(cell)
    return out


def export_failure(cell: Cell, result: dict, out) -> str | None:
    """What went wrong in the cell's export (`export.py`), or None: converted and equal to maester's logits, or
    refused as the table says; generated from in both cases."""
    refused = refusals_of(cell.values, stage="export")
    if result["torchao_imported"]:
        return "torchao was imported before the export: it would hide a checkpoint that pickles torchao's classes"
    if "error" in result:
        return result["error"]
    if refused:
        if result["convert"] != 2 or refused[0].message not in result["convert_error"]:
            return (f"maester convert to-hf was to refuse ({refused[0].message!r}), it exited {result['convert']}: "
                    f"{result['convert_error'][-2000:]}")
        return None
    if result["convert"] != 0:
        return f"maester convert to-hf exited {result['convert']}: {result['convert_error'][-2000:]}"
    return export.compare(out)


def _cpu(zygotes) -> float:
    """CPU seconds of this process and of the processes the zygotes forked that have ended."""
    return time.process_time() + sum(z.cpu_seconds for z in zygotes)


def _record(record_property, zygotes, start: tuple[float, float], passed: list[Cell], refused: int = 0) -> None:
    """What the run's closing line adds up (conftest.pytest_terminal_summary)."""
    record_property("matrix_cells", len(passed))
    record_property("matrix_refused", refused)
    record_property("matrix_pairs", sorted({t for c in passed for t in itertools.combinations(
        [(f, c.values[f]) for f in FACTORS], 2)}))
    record_property("matrix_start", start[0])
    record_property("matrix_end", time.time())
    record_property("matrix_cpu", _cpu(zygotes) - start[1])


def export_group(checkpoints: dict[str, object], cells: dict[str, Cell], files, zygote) -> dict[str, str]:
    """Phase 3 of the cells whose `checkpoints` (name -> step-3) are given, in one fresh process; returns why each
    cell that failed it failed."""
    spec = files.root / f"export-{next(iter(checkpoints))}.json"
    outs = {name: files.root / "exports" / name for name in checkpoints}
    spec.write_text(json.dumps([{"checkpoint": str(checkpoints[n]), "out": str(outs[n])} for n in checkpoints]))
    log = files.root / "logs" / f"{spec.stem}.log"
    pid = zygote.start("tests.combinations.export:export_checkpoints", [str(spec)], log,
                       env={"OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(files.root / "cache")})
    status = zygote.wait(pid, 900)
    if status != 0:
        zygote.kill(pid)
        raise AssertionError(f"the export process ended with {status}:\n{log.read_text()[-4000:]}")
    results = json.loads((spec.parent / (spec.name + ".result.json")).read_text())
    return {name: f"export: {why}" for name, result in zip(checkpoints, results)
            if (why := export_failure(cells[name], result, outs[name])) is not None}


def run_group(cells: list[Cell], files, zygotes, record_property) -> None:
    """Phases 1 and 2 of each cell, then one export process for all of them, then the comparisons; fails
    naming every cell that failed and why."""
    start = time.time(), _cpu(zygotes)
    by_name = {c.name: c for c in cells}
    failures: dict[str, str] = {}
    checkpoints: dict[str, object] = {}
    for cell in cells:
        try:
            checkpoints[cell.name] = run_cell(cell, files, zygotes[0])
        except CellFailed as e:
            failures[cell.name] = str(e)
    if checkpoints:
        failures.update(export_group(checkpoints, by_name, files, zygotes[1]))
    _record(record_property, zygotes, start, [c for c in cells if c.name not in failures])
    if failures:
        raise AssertionError("\n\n".join(f"{name} ({by_name[name].label()}):\n{why}" for name, why in failures.items()))


@pytest.mark.parametrize("group", range(GROUPS))
def test_a_slice_covering_every_pair_trains_resumes_and_exports(group, matrix_files, zygotes, record_property):
    run_group(groups(matrix(False)[0], GROUPS)[group], matrix_files, zygotes, record_property)


@pytest.mark.combinations
@pytest.mark.parametrize("group", range(2 * GROUPS))
def test_the_full_matrix_trains_resumes_and_exports(group, matrix_files, zygotes, record_property):
    run_group(groups(matrix(True)[0], 2 * GROUPS)[group], matrix_files, zygotes, record_property)


def test_the_table_refusals_are_refused_before_the_first_step(matrix_files, zygotes, record_property):
    start = time.time(), _cpu(zygotes)
    failures = []
    for cell in matrix(False)[1]:
        (refusal,) = refusals_of(cell.values)
        try:
            run_refused(cell, matrix_files, zygotes[0], refusal.message)
        except CellFailed as e:
            failures.append(f"{cell.name} ({cell.label()}):\n{e}")
    _record(record_property, zygotes, start, [], refused=len(matrix(False)[1]) - len(failures))
    assert not failures, "\n\n".join(failures)


def test_the_gpus_refusal_of_eager_float8_is_made_with_the_gpus_settings_on_the_cpu_too(matrix_files, zygotes):
    """The CPU emulates float8 and may run it eagerly; with a GPU's settings (no emulation) the config refuses
    float8 without compile on the CPU too, before step 1."""
    (refusal,) = [r for r in REFUSALS if r.where == "gpu"]
    values = {f: next(iter(v)) for f, v in FACTORS.items()} | {"precision": "float8-tensorwise", "compile": "off"}
    assert refusal.applies(values, "gpu") and not refusals_of(values, "cpu")
    run_refused(Cell(values, 600), matrix_files, zygotes[0], refusal.message,
                **{"training.float8.emulate": "false"})


def test_every_refusal_the_cpu_makes_is_in_a_cell_of_the_slice_and_no_trained_cell_is_refused():
    cells, refused = matrix(False)
    assert all(refusals_of(c.values) == [] for c in cells)
    on_cpu = [r for r in REFUSALS if r.where in ("everywhere", "cpu")]
    assert {id(refusals_of(c.values)[0]) for c in refused} == {id(r) for r in on_cpu if r.stage == "train"}
    exports = {id(r) for c in cells for r in refusals_of(c.values, stage="export")}
    assert exports == {id(r) for r in on_cpu if r.stage == "export"}


def test_the_slices_cover_what_they_claim():
    """Every pair maester accepts is in a cell that trains, every other pair in a refused cell; the full matrix has
    every accepted triple of layout x precision x checkpoint too; each refused cell has one refusal, on the CPU."""
    cells, refused = matrix(False)
    full, _ = matrix(True)
    pairs = {t for c in cells for t in itertools.combinations(
        [(f, c.values[f]) for f in FACTORS], 2)}
    refused_pairs = {t for c in refused for t in itertools.combinations([(f, c.values[f]) for f in FACTORS], 2)}
    for t in itertools.combinations([(f, v) for f in FACTORS for v in FACTORS[f]], 2):
        if t[0][0] == t[1][0]:
            continue
        assert t in (pairs if accepted(dict(t)) else refused_pairs), t
    triples = {tuple((f, c.values[f]) for f in RISKY) for c in full}
    assert {t for t in itertools.product(*([(f, v) for v in FACTORS[f]] for f in RISKY))
            if accepted(dict(t))} == triples
    assert all(len(refusals_of(c.values)) == 1 for c in refused)
    assert generate(False)[0] == [c.values for c in cells]  # the same slice every time


def test_the_page_is_the_one_the_table_writes():
    text = (REPO / "docs" / "combinations.md").read_text()
    assert BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END + "\n" == page(), \
        "docs/combinations.md differs from maester.combinations.page(): run maester.combinations.update_page"
