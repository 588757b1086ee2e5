"""The forkserver of multiprocessing, for the tests that start their ranks with `mp.start_processes`.

multiprocessing keeps one forkserver per process, and it imports the preload set last before it started: a later
preload is ignored, and the processes it forks import what the server lacks themselves (seconds of CPU each: a cold
run once spent about 70 s so in one module, when a module with a shorter list had started the worker's server). So
every such test asks for this list, the union of what they need, and `install` (tests/conftest.py) makes any other
preload set in a pytest worker this list plus its own: maester's data commands set one for their worker pool
(`maester.data.worker_pool`) when a test runs them in-process."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "maester.models.build", "maester.models.transformer",
           "maester.parallel.parallelize", "maester.parallel.pipeline", "maester.train.muon",
           "maester.train.nonfinite", "maester.train.trainer",
           "tests.distributed.test_chunked_loss_parallel", "tests.distributed.test_muon_layouts",
           "tests.distributed.test_pipeline_evaluation_p2p", "tests.distributed.test_tp_architectures",
           "tests.train.test_nonfinite"]


def install() -> None:
    """From now on, a preload set in this process is PRELOAD followed by the modules it names."""
    own = multiprocessing.forkserver.set_forkserver_preload
    if getattr(own, "union_of", None) is PRELOAD:
        return

    def set_forkserver_preload(modules):
        own([*PRELOAD, *(m for m in modules if m not in PRELOAD)])

    set_forkserver_preload.union_of = PRELOAD
    multiprocessing.forkserver.set_forkserver_preload = set_forkserver_preload


def context():
    """The forkserver context, its preload set to PRELOAD (for the server, if this starts it)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
