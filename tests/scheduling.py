"""How pytest-xdist's workers share the suite out: whole modules (their module fixtures then run once), except the
combination matrix's slices, each of which is a unit of its own; the longest units first, as tests/durations.tsv
says (seconds a cold run took, setup to teardown; a unit it lacks counts 2 s a test). Longest first keeps a long
unit from starting last and running alone at the end; a unit goes to a worker only when the worker is down to its
last test, so that no worker holds units another could start sooner.

`python -m tests.scheduling TIMES.cpu > tests/durations.tsv` writes the table again from a run with
_MAESTER_TEST_TIMES=TIMES (tests/conftest.py)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

DURATIONS = Path(__file__).with_name("durations.tsv")
OWN_UNITS = ("tests/combinations/test_matrix.py::test_a_slice_covering_every_pair",)
PER_TEST = 2.0  # seconds counted for each test of a unit the table lacks


def unit_of(nodeid: str) -> str:
    if nodeid.startswith(OWN_UNITS):
        return nodeid
    return nodeid.split("::", 1)[0]


def durations(path: Path = DURATIONS) -> dict[str, float]:
    if not path.exists():
        return {}
    table = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            seconds, unit = line.split("\t")
            table[unit] = float(seconds)
    return table


def longest_first(units: dict[str, dict[str, bool]], table: dict[str, float]) -> list[str]:
    return sorted(units, key=lambda u: -table.get(u, PER_TEST * len(units[u])))


class LongestFirst(LoadScopeScheduling):
    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self.ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        if not self.ordered:  # the first assignment: the queue holds every unit, in the collection's order
            order = longest_first(self.workqueue, durations())
            self.workqueue = collections.OrderedDict((u, self.workqueue[u]) for u in order)
            self.ordered = True
        super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        # A worker starts a test once it holds the next one (or is told to stop): it gets a unit when it is down to
        # the test it holds back, not sooner, so that no unit waits on a busy worker while another is free.
        if self._pending_of(self.assigned_work[node]) <= 1:
            self._assign_work_unit(node)


def _table(times_cpu: Path) -> str:
    seconds: collections.Counter[str] = collections.Counter()
    for line in times_cpu.read_text().splitlines():
        _cpu, wall, nodeid = line.split("\t")[:3]
        seconds[unit_of(nodeid)] += float(wall)
    rows = [f"{s:.0f}\t{u}" for u, s in seconds.most_common()]
    return "# seconds\tunit: written by python -m tests.scheduling from a cold run's _MAESTER_TEST_TIMES\n" + \
        "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(_table(Path(sys.argv[1])))
