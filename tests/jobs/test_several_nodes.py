"""What a job on several nodes takes from its config and its launcher, without a cluster (tests/slurm/test_multinode.py
runs such jobs on two SLURM nodes): `slurm.min_nodes` becomes `--nodes=MIN-MAX`, the launcher refuses a rendezvous
on the loopback, and the ranks' hosts are described as `maester status` shows them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from maester.config import load_config
from maester.jobs.slurm import render_slurm_script
from maester.parallel.hosts import describe_hosts, ranks_by_host
from tests.helpers import DEMO_CONFIG, clean_env


@pytest.mark.parametrize("template", ["default", "lumi"])
@pytest.mark.parametrize("overrides,line", [([], "#SBATCH --nodes=4"),
                                            (["--slurm.min_nodes=3"], "#SBATCH --nodes=3-4"),
                                            (["--slurm.min_nodes=4"], "#SBATCH --nodes=4")])
def test_min_nodes_asks_slurm_for_a_range_of_nodes(tmp_path, template, overrides, line):
    cfg = load_config(DEMO_CONFIG, ["--slurm.nodes=4", f"--slurm.template={template}", *overrides], environ={})
    lines = render_slurm_script(cfg, tmp_path / "job", tmp_path).splitlines()
    assert [x for x in lines if x.startswith("#SBATCH --nodes")] == [line]
    assert '  --nnodes="$SLURM_NNODES" --nproc_per_node=' in "\n".join(lines)  # the nodes SLURM gave


def test_more_min_nodes_than_nodes_is_refused():
    with pytest.raises(ValueError, match="slurm.min_nodes = 3 is more than slurm.nodes = 2"):
        load_config(DEMO_CONFIG, ["--slurm.nodes=2", "--slurm.min_nodes=3"], environ={})


def test_a_launcher_that_loses_the_rendezvous_store_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """The first node's launcher ended (its ranks stopped for a requeue) while this node's agent still watched its
    ranks: its next look at the store fails. One line and exit 6, nothing recorded (the first node's record or the
    requeue decides). Fault: torchrun's RendezvousConnectionError traceback, exit 1 (seen on the two-node cluster)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from maester.jobs.torchrun import FAILURE_FILE, main

    def store_gone(args):
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as e:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from e

    monkeypatch.setattr(torchrun, "run", store_gone)
    job = tmp_path / "job"
    job.mkdir()
    code = main(["--nnodes=2", "--nproc_per_node=1", "--rdzv_endpoint=node1:29500", "-m", "maester", "train",
                 str(job)])
    err = capsys.readouterr().err
    assert code == 6 and "lost the rendezvous store (Connection reset by peer)" in err and "Traceback" not in err
    assert not (job / FAILURE_FILE).exists()


def test_the_launcher_refuses_several_nodes_meeting_on_the_loopback(tmp_path):
    """Exit 2 (never restarted) and the failure recorded, before torchrun starts anything: on a cluster each node
    would wait for itself until the rendezvous timed out."""
    endpoint = "localhost:29500"
    job = tmp_path / "job"
    job.mkdir()
    out = subprocess.run([sys.executable, "-m", "maester.jobs.torchrun", "--nnodes=2", "--nproc_per_node=1",
                          "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=7", "-m", "maester",
                          "train", str(job)], capture_output=True, text=True, timeout=120, env=clean_env(),
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--rdzv_endpoint={endpoint} is each node's own loopback" in out.stderr
    assert "use the first node's hostname" in out.stderr
    assert {k: v for k, v in json.loads((job / "failure").read_text()).items() if k != "time" and k != "host"} == \
        {"exit_code": 2, "cause": "BAD_INPUT", "rank": None}


@pytest.mark.parametrize("nnodes,endpoint,refused", [("2", "127.0.0.1:29500", True), ("1:4", "[::1]:29500", True),
                                                     ("2", "LOCALHOST:1", True), ("2", "node1:29500", False),
                                                     ("1", "localhost:29500", False)])
def test_which_rendezvous_endpoints_are_loopback(nnodes, endpoint, refused):
    from torch.distributed import run

    from maester.jobs.torchrun import loopback_rendezvous

    args = run.parse_args([f"--nnodes={nnodes}", f"--rdzv_endpoint={endpoint}", "-m", "maester", "train", "job"])
    assert (loopback_rendezvous(args) is not None) == refused


def test_hosts_are_described_by_node_with_their_ranks():
    assert describe_hosts(ranks_by_host(["n1", "n1", "n2", "n2"])) == "2 node(s): n1 (ranks 0-1), n2 (ranks 2-3)"
    assert describe_hosts(ranks_by_host(["n1", "n2", "n1"])) == "2 node(s): n1 (ranks 0,2), n2 (rank 1)"
