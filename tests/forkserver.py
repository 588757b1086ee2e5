"""The forkserver of `torch.multiprocessing`, for the tests that start their ranks with `mp.start_processes`.

multiprocessing keeps one forkserver per process, and it imports the preload of the test that started it: a later
test's preload is ignored, and its ranks import what the server lacks themselves (seconds of CPU each: a cold run
once spent about 70 s so in one module, when a module with a shorter list had started the worker's server). So every
such test asks for this list, the union of what they need."""

from __future__ import annotations

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "maester.models.build", "maester.models.transformer",
           "maester.parallel.parallelize", "maester.parallel.pipeline", "maester.train.muon",
           "maester.train.nonfinite", "maester.train.trainer",
           "tests.distributed.test_chunked_loss_parallel", "tests.distributed.test_muon_layouts",
           "tests.distributed.test_pipeline_evaluation_p2p", "tests.distributed.test_tp_architectures",
           "tests.train.test_nonfinite"]


def context():
    """The forkserver context, its preload set to PRELOAD (for the server, if this starts it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
