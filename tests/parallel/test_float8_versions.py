"""G13: pyproject.toml's torchao requirement (the float8 extra and the dev group) follows the torchao releases
maester accepts (`maester.parallel.float8.TORCHAO_TORCH`), so that `pip install 'maester[float8]'` never fetches a
release the run then refuses. Needs no torchao."""

from __future__ import annotations

import tomllib

from maester.parallel.float8 import TORCHAO_TORCH, torchao_requirement, version_problem
from tests.helpers import REPO


def test_pyproject_bounds_torchao_by_the_accepted_releases():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirement = torchao_requirement()
    assert requirement == "torchao>=0.16,<0.19"  # today's table: 0.16 to 0.18
    assert project["project"]["optional-dependencies"]["float8"] == [requirement]
    assert [r for r in project["dependency-groups"]["dev"] if r.startswith("torchao")] == [requirement]
    newest = max(TORCHAO_TORCH)
    beyond = f"{newest[0]}.{newest[1] + 1}.0"
    assert version_problem("2.15.0", beyond) is not None  # the first release the bound keeps out is refused
    assert version_problem(f"{TORCHAO_TORCH[newest][1][0]}.{TORCHAO_TORCH[newest][1][1]}.0",
                           f"{newest[0]}.{newest[1]}.0") is None
