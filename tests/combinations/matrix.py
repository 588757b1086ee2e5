"""The cells of the combination matrix, made deterministically from `maester.combinations.FACTORS`: a greedy
covering array (AETG's construction: each new cell starts from a tuple not yet covered and takes, factor by factor,
the value that covers most new tuples; of several seeded candidates the one covering most per unit of cost wins).

`generate(full=False)`: every pair of values of any two factors is in a cell that trains, unless the table refuses
every cell holding it, in which case it is in a refused cell. `full` adds every triple of layout x precision x
checkpoint. Cells that train avoid the table's refusals; each refused cell is refused by one entry only, so that
the error it must give is known.
"""

from __future__ import annotations

import itertools
import random

from maester.combinations import FACTORS, REFUSALS, accepted
from tests.combinations.cells import WORLD

RISKY = ("layout", "precision", "checkpoint")
Tuple = tuple[tuple[str, str], ...]


# CPU seconds of a cell's training phases on the 2-core machine of the suite (tests/combinations runs, eager);
# compiling adds about COMPILE per process (the kill's and the resume's, with a cold Inductor cache; a third of that
# warm), twice that for a mixture of experts, whose routing breaks each block into several graphs
LAYOUT_COST = {"one": 3, "ddp": 4, "pp": 4, "fsdp": 7, "ep": 8, "cp": 6, "tp": 8, "hsdp": 16, "tp_fsdp": 26}
COMPILE = 15


def cost(cell: dict[str, str]) -> float:
    """The CPU seconds a cell takes, roughly: its processes, and compiling (far the most)."""
    compiling = COMPILE * WORLD[cell["layout"]] * (1 + (cell["family"] == "moe")) if cell["compile"] == "on" else 0
    return LAYOUT_COST[cell["layout"]] + compiling + 1


def tuples_of(cell: dict[str, str], groups: list[tuple[str, ...]]) -> set[Tuple]:
    return {tuple((f, cell[f]) for f in group) for group in groups}


def requirements(full: bool) -> list[tuple[str, ...]]:
    """The groups of factors whose value tuples must all be covered."""
    groups = list(itertools.combinations(FACTORS, 2))
    return groups + ([RISKY] if full else [])


def _complete(start: dict[str, str], wanted: set[Tuple], groups, rng: random.Random,
              allowed: frozenset[int]) -> dict[str, str]:
    """`start` with a value for every other factor, refused by nothing but `allowed`, covering much of `wanted`."""
    cell = dict(start)
    factors = [f for f in FACTORS if f not in cell]
    rng.shuffle(factors)
    for factor in factors:
        options = list(FACTORS[factor])
        rng.shuffle(options)
        scored = []
        for value in options:
            trial = {**cell, factor: value}
            if not accepted(trial, allowed=allowed):
                continue
            gain = sum(1 for g in groups if factor in g and all(f in trial for f in g)
                       and tuple((f, trial[f]) for f in g) in wanted)
            penalty = 0.001 * (COMPILE * (factor == "compile" and value == "on")
                               + (LAYOUT_COST[value] if factor == "layout" else 0))
            scored.append((gain - penalty, rng.random(), value))  # ties: any, but the same for a seed
        cell[factor] = max(scored)[2]
    return {f: cell[f] for f in FACTORS}


def generate(full: bool = False, seed: int = 0, candidates: int = 10) -> tuple[list[dict], list[dict]]:
    """(cells that train, refused cells): the same for the same arguments."""
    rng = random.Random(seed)
    groups = requirements(full)
    wanted = {tuple((f, v) for f, v in zip(g, values)) for g in groups
              for values in itertools.product(*(FACTORS[f] for f in g))}
    uncovered = {t for t in wanted if accepted(dict(t))}
    refused_wanted = {t for t in wanted - uncovered if len(t) == 2}
    cells: list[dict] = []
    while uncovered:
        best, best_score = None, -1.0
        for _ in range(candidates):
            cell = _complete(dict(rng.choice(sorted(uncovered))), uncovered, groups, rng, frozenset())
            score = len(tuples_of(cell, groups) & uncovered) / cost(cell)
            if score > best_score:
                best, best_score = cell, score
        cells.append(best)
        uncovered -= tuples_of(best, groups)
    refused: list[dict] = []
    while refused_wanted:  # each refused by one entry of the table only, holding as many refused pairs as it can
        target = dict(rng.choice(sorted(refused_wanted)))
        entry = next(frozenset({i}) for i in range(len(REFUSALS)) if accepted(target, allowed=frozenset({i})))
        cell = _complete(target, refused_wanted, groups, rng, entry)
        refused.append(cell)
        refused_wanted -= tuples_of(cell, groups)
    return cells, refused


def covered_pairs(cells: list[dict]) -> int:
    groups = list(itertools.combinations(FACTORS, 2))
    return len(set().union(*(tuples_of(c, groups) for c in cells))) if cells else 0
