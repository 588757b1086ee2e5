"""How the suite is shared out among pytest-xdist's workers (tests/scheduling.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.scheduling import LongestFirst, PER_TEST, _table, durations, longest_first, unit_of

SLICE = "tests/combinations/test_matrix.py::test_a_slice_covering_every_pair_trains_resumes_and_exports[3]"


def test_a_module_is_one_unit_and_each_matrix_slice_its_own():
    assert unit_of("tests/data/test_sft.py::test_a[x::y]") == "tests/data/test_sft.py"
    assert unit_of(SLICE) == SLICE
    assert unit_of("tests/combinations/test_matrix.py::test_the_slices_cover_what_they_claim") == \
        "tests/combinations/test_matrix.py"


def test_the_longest_units_go_first_and_an_unknown_one_counts_its_tests(tmp_path):
    times = tmp_path / "t.cpu"
    times.write_text(f"1.0\t30.0\t{SLICE}\tgw0\t0\n0.5\t4.0\ttests/a.py::x\tgw1\t0\n0.5\t5.0\ttests/a.py::y\tgw1\t0\n")
    table_file = tmp_path / "durations.tsv"
    table_file.write_text(_table(times))
    table = durations(table_file)
    assert table == {SLICE: 30.0, "tests/a.py": 9.0}
    units = {"tests/a.py": {"tests/a.py::x": False, "tests/a.py::y": False}, SLICE: {SLICE: False},
             "tests/new.py": {f"tests/new.py::t{i}": False for i in range(6)}}  # 6 tests: 12 s
    assert 6 * PER_TEST > 9.0
    assert longest_first(units, table) == [SLICE, "tests/new.py", "tests/a.py"]
    assert durations(tmp_path / "missing.tsv") == {}


class Node:
    """What the scheduler uses of a pytest-xdist worker: the tests it is sent, and shutdown."""

    def __init__(self, name):
        self.name, self.sent, self.shutting_down = name, [], False

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def test_a_worker_gets_the_next_unit_only_when_down_to_the_test_it_holds_back(tmp_path, monkeypatch):
    collection = [SLICE, "tests/a.py::x", "tests/a.py::y", "tests/b.py::z"]
    monkeypatch.setattr("tests.scheduling.durations", lambda: {SLICE: 100.0, "tests/a.py": 50.0, "tests/b.py": 1.0})
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=False, dist="load", tx=[], numprocesses=1),
                             getvalue=lambda name: {"tx": [], "numprocesses": 1}.get(name))
    monkeypatch.setattr("xdist.scheduler.loadscope.parse_tx_spec_config", lambda config: ["popen"])
    sched = LongestFirst(config)
    node = Node("gw0")
    sched.add_node(node)
    sched.add_node_collection(node, collection)
    sched.schedule()
    # the slice (one test, held back until a next one comes) and then the next longest unit, a.py
    assert node.sent == [0, 1, 2] and not node.shutting_down
    sched.mark_test_complete(node, 0)
    assert node.sent == [0, 1, 2]  # two tests of a.py still to run: nothing more yet
    sched.mark_test_complete(node, 1)
    assert node.sent == [0, 1, 2, 3]  # down to one: b.py comes
    sched.mark_test_complete(node, 2)
    assert node.shutting_down  # nothing left to hand out
