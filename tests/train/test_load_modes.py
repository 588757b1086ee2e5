"""Finetune mode and named load modes: which parts of `checkpoint.init_from` a new run takes, observed in the
run's real state (weights, optimizer moments, the LR of its first step, the batch it takes next, its step, RNG)."""

from __future__ import annotations

import json
import os
import signal
import typing

import pytest
import torch

from maester.config import LOAD_MODES, CheckpointConfig, ConfigError, load_config
from maester.train.checkpoint import resolve_checkpoint
from maester.train.checkpoint_reader import load_model_weights
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer, write_seed_checkpoint
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides, torchrun, write_corpus

SOURCE_STEPS = 4
LR = 3e-3
# The source job: constant LR after a warmup of 2, weight decay 0.1, checkpoint at its last step.
SOURCE = dict(training__steps=SOURCE_STEPS, schedule__name="constant", schedule__warmup_steps=2,
              checkpoint__interval=0, optimizer__lr=LR)
# Every new job: a warmup of 4 (a fresh schedule shows as LR/4 at its first step), another weight decay, no saves.
TARGET = dict(training__steps=6, schedule__name="constant", schedule__warmup_steps=4, optimizer__lr=LR,
              optimizer__weight_decay=0.05, checkpoint__interval=0, checkpoint__save_final="false")
FRESH_STEP_OFFSET = 2  # where a run that does not take the step starts: neither 0 nor the source's step

# Written out here, not read from LOAD_MODES: what each mode must take (the RNG state comes with `continue` only).
EXPECTED = {
    "continue": {"model", "optimizer", "schedule", "data", "step", "rng"},
    "model_only": {"model"},
    "model_data": {"model", "data"},
    "model_opt_data": {"model", "optimizer", "data"},
    "reset_optimizer": {"model", "schedule", "data", "step"},
    "transfer": {"model", "optimizer"},
    "transfer_with_lr": {"model", "optimizer", "schedule", "step"},
    "cooldown": {"model", "optimizer", "data", "step"},
    "model_partial": {"model"},  # here every weight: the source shares all its names with the target
}
# A cooldown's own schedule has no warmup: a linear decay over its 2 steps is at 1/2 on its first step.
COOLDOWN = dict(schedule__name="linear", schedule__warmup_steps=0)


def make_trainer(corpus, root, name, **extra) -> Trainer:
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", name, **extra), environ={})
    return Trainer(cfg, cfg.job_dir)


def peek(loader) -> list:
    """The micro-batches the loader yields next, leaving its position where it was."""
    state = loader.state_dict()
    batches = loader.next_step()
    loader.load_state_dict(state)
    return batches


def same_batches(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
                                    for x, y in zip(a, b))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A job trained SOURCE_STEPS steps, its in-memory state (equal to its last checkpoint) and the batch it would
    take next."""
    root = tmp_path_factory.mktemp("load_modes")
    corpus = write_corpus(root / "data" / "corpus.parquet")
    trainer = make_trainer(corpus, root, "source", **SOURCE)
    result = trainer.train()
    assert result.checkpoint.name == f"step-{SOURCE_STEPS}"
    next_batch = trainer.loader.next_step()
    trainer.loader.close()
    return root, corpus, trainer, next_batch


def test_every_load_mode_in_the_table_is_a_config_choice():
    choices = typing.get_args(CheckpointConfig.model_fields["load_mode"].annotation)
    assert set(choices) == set(LOAD_MODES) == set(EXPECTED)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_load_mode_takes_exactly_its_parts(source, mode):
    root, corpus, src, src_next = source
    takes = EXPECTED[mode]
    offset = {} if "step" in takes else {"checkpoint__step_offset": FRESH_STEP_OFFSET}
    if mode == "cooldown":
        offset = COOLDOWN
    fresh = make_trainer(corpus, root, f"fresh-{mode}", **{**TARGET, **offset})
    fresh_rng = torch.get_rng_state()
    target = make_trainer(corpus, root, f"target-{mode}", **{**TARGET, **offset},
                          checkpoint__init_from=str(src.job_dir), checkpoint__load_mode=mode)
    target_rng = torch.get_rng_state()

    # model: the source's weights (a fresh run's differ)
    assert same_weights(target.model, src.model) and not same_weights(fresh.model, src.model)

    # optimizer: the source's moments and step counts, or no state at all; hyperparameters always the config's
    if "optimizer" in takes:
        for p, q in zip(target.model.parameters(), src.model.parameters()):
            mine, theirs = target.optimizer.state[p], src.optimizer.state[q]
            assert torch.equal(mine["exp_avg"], theirs["exp_avg"])
            assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])
            assert int(mine["step"]) == SOURCE_STEPS
    else:
        assert len(target.optimizer.state) == 0
    assert {g["name"]: g["weight_decay"] for g in target.optimizer.param_groups}["decay"] == 0.05

    # data: the batch the source would have taken next, or a fresh run's first batch
    batch = peek(target.loader)
    fresh_first = fresh.loader.next_step()
    assert not same_batches(src_next, fresh_first)
    assert same_batches(batch, src_next if "data" in takes else fresh_first)

    # step: the source's, or the configured offset
    start = SOURCE_STEPS if "step" in takes else FRESH_STEP_OFFSET
    assert target.step == start
    assert target.tokens_seen == (src.tokens_seen if "step" in takes else 0)

    # RNG: the source's saved state, or the one a fresh run of this config has
    saved_rng = torch.load(resolve_checkpoint(src.job_dir) / "rng" / "rank0.pt", weights_only=True)["torch"]
    assert not torch.equal(saved_rng, fresh_rng)
    assert torch.equal(target_rng, saved_rng if "rng" in takes else fresh_rng)

    # schedule: the LR of the first step. Taken, it continues the source's schedule (past this config's warmup of
    # 4 at step 5: the full LR); fresh, it starts its warmup at the run's first step (step 3: LR/4, not 3/4).
    target.train()
    first = read_metrics(target.job_dir / "metrics.jsonl")[0]
    assert first["step"] == start + 1
    expected_lr = LR / 2 if mode == "cooldown" else LR if "schedule" in takes else LR / 4
    assert first["lr"] == pytest.approx(expected_lr, rel=1e-12)


def test_finetune_restarts_from_its_own_checkpoint(source):
    """A model_only finetune killed after step 5 resumes from its own step-3, never again from init_from."""
    root, corpus, src, _ = source
    fine = dict(training__steps=8, checkpoint__interval=3, checkpoint__init_from=str(src.job_dir))
    killed = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, root / "jobs", "fine", **fine)], root,
                         env=clean_env(_MAESTER_FAULT="after_step:5"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "load_mode model_only: took model; fresh: optimizer, schedule, data, step" in killed.stderr
    job = root / "jobs" / "fine"
    assert os.readlink(job / "checkpoints" / "latest") == "step-3"
    own = json.loads((job / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert own["init_from"] == str(resolve_checkpoint(src.job_dir)) and own["load_mode"] == "model_only"

    restarted = make_trainer(corpus, root, "fine", **fine)
    assert restarted.step == 3
    probe = make_trainer(corpus, root, "probe", training__steps=2)
    load_model_weights(job / "checkpoints" / "step-3", probe.model)
    assert same_weights(restarted.model, probe.model) and not same_weights(restarted.model, src.model)
    # its own optimizer (3 steps of it) and its own data position (its 4th batch), not the source's
    assert {int(s["step"]) for s in restarted.optimizer.state.values()} == {3}
    for _ in range(3):
        probe.loader.next_step()
    assert same_batches(peek(restarted.loader), probe.loader.next_step())

    result = restarted.train()
    assert result.step == 8
    final = json.loads((result.checkpoint / "trainer_state.json").read_text())
    assert final["load_mode"] == "model_only" and final["init_from"] == own["init_from"]


def test_checkpoint_from_one_process_starts_a_two_process_fsdp_job(source):
    """`transfer` from a 1-process checkpoint into 2 FSDP processes: weights and optimizer moments resharded, so
    the losses equal those of the same run on one process."""
    root, corpus, src, _ = source
    run = dict(training__steps=3, schedule__name="constant", schedule__warmup_steps=1, optimizer__lr=LR,
               checkpoint__interval=0, checkpoint__init_from=str(src.job_dir), checkpoint__load_mode="transfer")
    one = make_trainer(corpus, root, "transfer-1", **run)
    one.train()
    expected = [r["loss"] for r in read_metrics(one.job_dir / "metrics.jsonl")]

    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG), *tiny_overrides(corpus, root / "jobs", "transfer-2", **run)], root)
    assert out.returncode == 0, out.stderr
    job = root / "jobs" / "transfer-2"
    two = torchrun(2, ["train", str(job)], root)
    assert two.returncode == 0, two.stderr[-4000:]
    assert "load_mode transfer: took model, optimizer" in two.stderr
    got = [r["loss"] for r in read_metrics(job / "metrics.jsonl")]
    assert got == pytest.approx(expected, rel=1e-5)
    state = json.loads((job / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert state["load_mode"] == "transfer" and state["step"] == 3 and state["schedule_start"] == 0


def test_cooldown_from_a_stable_checkpoint_equals_the_wsd_run(tmp_path, corpus):
    """A WSD run of 8 steps decays linearly over its last 2; a cooldown from its stable step-6 checkpoint with a
    2-step linear decay trains the same steps 7 and 8: same LRs, same data, same losses, bit for bit."""
    wsd = dict(training__steps=8, schedule__name="wsd", schedule__decay_fraction=0.25, schedule__warmup_steps=2,
               optimizer__lr=LR, checkpoint__interval=2, checkpoint__keep_last=4)
    full = make_trainer(corpus, tmp_path, "wsd", **wsd)
    full.train()
    expected = read_metrics(full.job_dir / "metrics.jsonl")[-2:]
    cool = make_trainer(corpus, tmp_path, "cool", training__steps=8, optimizer__lr=LR, checkpoint__interval=0,
                        checkpoint__init_from=str(full.job_dir / "checkpoints" / "step-6"),
                        checkpoint__load_mode="cooldown", **COOLDOWN)
    assert cool.step == 6
    cool.train()
    got = read_metrics(cool.job_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [7, 8] == [r["step"] for r in expected]
    assert [r["lr"] for r in got] == [r["lr"] for r in expected] == [LR / 2, 0.0]
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]

    with pytest.raises(ValueError, match=r"step-8 \(step 8\) is not in the stable phase of its schedule \(wsd\): "
                                         r"its LR multiplier there is 0, not 1"):
        make_trainer(corpus, tmp_path, "late", training__steps=10, checkpoint__load_mode="cooldown",
                     checkpoint__init_from=str(full.job_dir / "checkpoints" / "step-8"), **COOLDOWN)


def test_cooldown_with_a_warmup_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"schedule.warmup_steps = 3 with checkpoint.load_mode = 'cooldown'"):
        load_config(None, tiny_overrides(corpus, tmp_path, checkpoint__init_from="x", schedule__warmup_steps=3,
                                         checkpoint__load_mode="cooldown"), environ={})


# --- bad combinations ---------------------------------------------------------------------------------------------

def test_load_mode_without_init_from_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.load_mode = 'transfer' needs checkpoint.init_from"):
        load_config(None, tiny_overrides(corpus, tmp_path, checkpoint__load_mode="transfer"), environ={})


def test_step_offset_with_a_mode_that_takes_the_step_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.step_offset = 3 conflicts with checkpoint.load_mode = "
                                          r"'transfer_with_lr'"):
        load_config(None, tiny_overrides(corpus, tmp_path, checkpoint__init_from="x", checkpoint__step_offset=3,
                                         checkpoint__load_mode="transfer_with_lr"), environ={})


def test_step_offset_past_the_last_step_is_refused_with_the_config(corpus, tmp_path):
    """GPT-NeoX's train_iters 30 with iteration_offset 220 is training.steps = 250: the config says so at once."""
    with pytest.raises(ConfigError, match=r"checkpoint.step_offset = 220 leaves nothing to train with training.steps "
                                          r"= 30: training.steps is the number of the last step, not a count .* set "
                                          r"training.steps = 250"):
        load_config(None, tiny_overrides(corpus, tmp_path, training__steps=30, checkpoint__step_offset=220),
                    environ={})
    assert load_config(None, tiny_overrides(corpus, tmp_path, training__steps=250, checkpoint__step_offset=220),
                       environ={}).checkpoint.step_offset == 220


def test_the_first_step_after_an_offset_is_logged(corpus, tmp_path):
    """Like step 1 of a fresh run: `maester status` and `report` see the run from its first step."""
    trainer = make_trainer(corpus, tmp_path, "offset", **{**TARGET, "checkpoint__step_offset": FRESH_STEP_OFFSET},
                           logging__interval=4)
    trainer.train()
    assert [r["step"] for r in read_metrics(trainer.job_dir / "metrics.jsonl")] == [FRESH_STEP_OFFSET + 1, 4, 6]


def test_init_from_a_later_step_than_training_steps_is_refused_before_loading(source, tmp_path, monkeypatch):
    _, corpus, src, _ = source

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the steps were checked")

    monkeypatch.setattr("maester.train.trainer.build_training_model", no_model)
    with pytest.raises(ValueError, match=f"is at step {SOURCE_STEPS} and checkpoint.load_mode = 'continue' continues "
                                         f"from it, but training.steps = 4: .* set training.steps = {SOURCE_STEPS + 4}"):
        make_trainer(corpus, tmp_path, "late", training__steps=4, checkpoint__init_from=str(src.job_dir),
                     checkpoint__load_mode="continue")


@pytest.mark.parametrize("mode, missing", [("transfer", "the optimizer state"), ("model_data", "the data position"),
                                           ("continue", "the optimizer state")])
def test_parts_a_seed_checkpoint_lacks_are_refused(corpus, tmp_path, mode, missing):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "seed"), environ={})
    write_seed_checkpoint(cfg, cfg.job_dir)
    with pytest.raises(ValueError, match=f"load mode '{mode}' takes {missing}, but checkpoint .* has none"):
        make_trainer(corpus, tmp_path, "new", checkpoint__init_from=str(cfg.job_dir), checkpoint__load_mode=mode)
    # its weights alone start a finetune
    fine = make_trainer(corpus, tmp_path, "fine", checkpoint__init_from=str(cfg.job_dir))
    probe = make_trainer(corpus, tmp_path, "probe", training__seed=1)
    assert not same_weights(fine.model, probe.model)
    load_model_weights(resolve_checkpoint(cfg.job_dir), probe.model)
    assert same_weights(fine.model, probe.model) and fine.step == 0


def test_data_position_of_other_data_is_refused(source, tmp_path):
    _, _, src, _ = source
    other = write_corpus(tmp_path / "other" / "c.parquet", seed=1)
    with pytest.raises(ValueError, match="load_mode = 'model_data' takes the data position of .*different data"):
        make_trainer(other, tmp_path, "other", checkpoint__init_from=str(src.job_dir),
                     checkpoint__load_mode="model_data")


def test_a_seed_checkpoint_and_init_from_together_are_refused(source, tmp_path):
    _, corpus, src, _ = source
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "both",
                                           checkpoint__init_from=str(src.job_dir)), environ={})
    write_seed_checkpoint(cfg, cfg.job_dir)
    with pytest.raises(ValueError, match="has the seed checkpoint .* and checkpoint.init_from is set too"):
        Trainer(cfg, cfg.job_dir)
