"""`python -m maester.jobs.torchrun ARGS`: torchrun (`torch.distributed.run`, the same arguments) as the job
script runs it on each node, ending the way a job script can read.

- It exits with the exit code of the rank that failed first (torchrun itself always exits 1), a signal as
  128 + its number: 2 is a bad config, 3 a stop for a requeue, 137 a rank killed (see `maester.exit_codes`).
- It writes that first failure to `<job>/failure` (JSON: exit_code, cause, rank, host, time), unless a node's
  launcher already did: the job script reads it to decide on a restart (`maester.jobs.job_end`).
- Several nodes meeting at a loopback address (`--rdzv_endpoint=localhost:...`, `127.0.0.1`, `::1`) is refused with
  exit 2 before any training: each node would reach only itself, and the nodes would wait for each other until
  the rendezvous timed out.
- Instead of torchrun's `ChildFailedError` traceback and its per-process lines, a failure is one line naming
  the rank and the cause (the rank's own traceback, if it had one, is in the log above it), and a stop for a
  requeue adds nothing to the trainer's own line: it reads as the clean stop it is.
- A node whose launcher loses the rendezvous store (the first node's launcher ended first, after its ranks stopped
  or failed) says so in one line and exits 6 (COLLECTIVE), recording nothing: not torchrun's traceback.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path

from maester import exit_codes
from maester.files import create_new
from maester.progress import stderr_line

FAILURE_FILE = "failure"


def root_cause(failures: dict) -> tuple[int, object]:
    """(global rank, ProcessFailure) of the first failure: the earliest; within the same second, a process that
    exited on its own before one killed by a signal, and SIGTERM (torchrun ending the others) last."""
    def order(item):
        failure = item[1]
        code = failure.exitcode
        kind = 0 if code > 0 else (2 if code == -signal.SIGTERM else 1)
        return failure.timestamp, kind, item[0]

    return min(failures.items(), key=order)


def shell_status(code: int) -> int:
    """A worker's exit code as a shell reports it: a signal N (torchrun's -N) as 128 + N."""
    return 128 - code if code < 0 else code


def record_failure(job_dir: Path, record: dict) -> bool:
    """Write `<job>/failure` unless it exists (created exclusively: the first node's launcher wins)."""
    text = json.dumps({**record, "time": datetime.now(UTC).isoformat(timespec="seconds")}) + "\n"
    return create_new(job_dir / FAILURE_FILE, text)


def _job_dir(args) -> Path:
    if not (args.module and args.training_script == "maester" and args.training_script_args[:1] == ["train"]):
        raise ValueError(f"maester.jobs.torchrun runs `-m maester train JOB_DIR`, not "
                         f"{args.training_script} {' '.join(args.training_script_args)}")
    return Path(args.training_script_args[-1])


def loopback_rendezvous(args) -> str | None:
    """Why a rendezvous of several nodes cannot work from its endpoint alone (None: it can): a loopback name or
    address, which on every node means that node itself."""
    import ipaddress

    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    most = str(args.nnodes).split(":")[-1]
    if not most.isdigit() or int(most) < 2 or not args.rdzv_endpoint:
        return None
    host = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)[0].lower()
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost" or host.startswith("localhost.")
    if not loopback:
        return None
    return (f"--rdzv_endpoint={args.rdzv_endpoint} is each node's own loopback, so the nodes of --nnodes={args.nnodes} "
            f"would never meet: use the first node's hostname (`scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
            f"head -n 1`, the job script's MASTER_ADDR)")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    args = torchrun.parse_args(argv)
    job_dir = _job_dir(args)
    host = socket.gethostname()
    refused = loopback_rendezvous(args)
    if refused:
        stderr_line(f"torchrun on {host}: {refused}")
        record_failure(job_dir, {"exit_code": exit_codes.BAD_INPUT, "cause": exit_codes.name_of(exit_codes.BAD_INPUT),
                                 "rank": None, "host": host})
        return exit_codes.BAD_INPUT
    # torchrun's lines as a worker ends ("failed (exitcode: 3) local_rank: 0", "Sending process N closing signal
    # SIGTERM") say, for each process, what the one line below says.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, failure = root_cause(e.failures)
        status = shell_status(failure.exitcode)
        cause = exit_codes.name_of(status)
        if status == exit_codes.REQUEUE:  # the trainer said why it stopped, and the job script says what it does
            return status
        others = len(e.failures) - 1
        stderr_line(f"torchrun on {host}: rank {rank} (pid {failure.pid}) failed with exit code {status} ({cause})"
                    + (f"; {others} other local rank(s) ended after it" if others else ""))
        record_failure(job_dir, {"exit_code": status, "cause": cause, "rank": rank, "host": host})
        return status
    except SignalException as e:  # torchrun itself was signalled (scancel, scontrol requeue): its workers stopped
        stderr_line(f"torchrun on {host}: got {signal.Signals(e.sigval).name}; the training processes have stopped")
        return 128 + int(e.sigval)
    except RendezvousConnectionError as e:
        # The launcher of the node that hosts the rendezvous store (the first) ended while this node's ranks ran:
        # its ranks stopped (a requeue) or failed, and it said so. torchrun stopped the ranks here; nothing is
        # recorded, so that the first node's record (or the requeue) decides what the job does.
        stderr_line(f"torchrun on {host}: lost the rendezvous store ({e.__cause__ or e}): the first node's launcher "
                    f"has ended; the training processes here have stopped")
        return exit_codes.COLLECTIVE
    return 0


if __name__ == "__main__":
    sys.exit(main())
