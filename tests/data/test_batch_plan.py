"""The split of a step's batch is derived and checked in one place, `BatchPlan`, and the run's comes from
`ParallelDims.batch_plan`: every loader and the trainer read the same numbers."""

import pytest

from maester.config import load_config
from maester.data.batch import BatchPlan
from maester.parallel.dims import ParallelDims


@pytest.mark.parametrize("global_batch,micro,dp,accumulation", [(8, 2, 1, 4), (8, 2, 2, 2), (8, 1, 4, 2), (6, 3, 2, 1)])
def test_accumulation_steps_follow_from_the_split(global_batch, micro, dp, accumulation):
    plan = BatchPlan(global_batch, micro, dp)
    assert plan.per_rank * dp == global_batch and plan.accumulation_steps == accumulation
    assert plan.accumulation_steps * plan.micro_batch * plan.dp_size == global_batch


@pytest.mark.parametrize("args", [(6, 2, 4), (8, 3, 1), (0, 1, 1), (4, 1, 2, 2)])
def test_a_batch_that_does_not_split_is_refused(args):
    with pytest.raises(ValueError, match="does not split|positive sizes"):
        BatchPlan(*args)


def test_the_runs_plan_is_in_sequences_of_the_config():
    cfg = load_config(None, ["--data.seq_len=16", "--training.batch_unit=tokens", "--training.global_batch_size=256",
                             "--training.micro_batch_size=32", "--parallel.dp_shard=2"], environ={})
    plan = ParallelDims.from_config(cfg, 2).batch_plan(cfg, dp_rank=1)
    assert (plan.global_batch, plan.micro_batch, plan.dp_size, plan.dp_rank) == (16, 2, 2, 1)
    assert plan.accumulation_steps == 4
    with pytest.raises(ValueError, match="does not split into 2 data-parallel rank"):
        ParallelDims.from_config(cfg.model_copy(update={"training": cfg.training.model_copy(
            update={"global_batch_size": 96})}), 2)
