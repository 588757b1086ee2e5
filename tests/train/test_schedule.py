import math

import pytest

from maester.config import ScheduleConfig
from maester.train.schedule import lr_multiplier, warmup_clamped


def curve(total=100, **kw):
    cfg = ScheduleConfig(**kw)
    return [lr_multiplier(cfg, s, total) for s in range(1, total + 1)]


def test_linear_warmup_reaches_one():
    c = curve(name="constant", warmup_steps=10)
    assert c[:10] == pytest.approx([s / 10 for s in range(1, 11)])
    assert c[10:] == [1.0] * 90


def test_cosine_decays_to_min_ratio():
    c = curve(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert c[9] == 1.0
    mid = 10 + 45  # halfway through the decay
    assert c[mid - 1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert c[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(c[10:], c[11:]))


def test_linear_decay():
    c = curve(name="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert c[0] == pytest.approx(0.99) and c[49] == pytest.approx(0.5) and c[-1] == 0.0


@pytest.mark.parametrize("shape, at_half", [("linear", 0.5), ("1-sqrt", 1 - math.sqrt(0.5)),
                                            ("cosine", 0.5)])
def test_wsd_stable_then_decay(shape, at_half):
    c = curve(name="wsd", warmup_steps=10, decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.0)
    assert c[9] == 1.0 and c[79] == 1.0  # stable until step 80
    assert c[89] == pytest.approx(at_half)  # step 90 is halfway through the 20 decay steps
    assert c[-1] == pytest.approx(0.0)


def test_wsd_min_ratio_floor():
    c = curve(name="wsd", decay_fraction=0.5, min_lr_ratio=0.2)
    assert min(c) == pytest.approx(0.2) and c[-1] == pytest.approx(0.2)


def test_step_decay_drops_by_gamma_after_each_milestone():
    c = curve(name="step", warmup_steps=5, step_milestones=[40, 70], step_gamma=0.5)
    assert c[:5] == pytest.approx([s / 5 for s in range(1, 6)])
    assert c[5:40] == [1.0] * 35 and c[40:70] == [0.5] * 30 and c[70:] == [0.25] * 30


@pytest.mark.parametrize("kw, message", [
    (dict(name="step"), "schedule.name = 'step' needs schedule.step_milestones"),
    (dict(name="step", step_milestones=[50, 20]), "must be positive and increasing"),
    (dict(name="cosine", step_milestones=[20]), "schedule.name is 'cosine', not 'step'"),
])
def test_step_decay_settings_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**kw)


@pytest.mark.parametrize("name", ["constant", "cosine", "linear", "wsd"])
def test_a_warmup_longer_than_the_run_is_clamped_with_a_warning(name):
    c = curve(total=4, name=name, warmup_steps=20)
    assert c == pytest.approx([0.25, 0.5, 0.75, 1.0])  # warms up over all 4 steps, reaching the peak at the last
    assert warmup_clamped(ScheduleConfig(warmup_steps=20), 4) == (
        "schedule.warmup_steps = 20 is longer than the 4 step(s) this run schedules: warming up over all 4 (set "
        "schedule.warmup_steps, or schedule.warmup_fraction for a share of the run)")
    assert warmup_clamped(ScheduleConfig(warmup_steps=4), 4) is None


def test_warmup_fraction_is_a_share_of_the_run():
    long, short = curve(total=200, name="constant", warmup_fraction=0.1), curve(total=10, name="constant",
                                                                                  warmup_fraction=0.1)
    assert long[:21] == pytest.approx([s / 20 for s in range(1, 21)] + [1.0])
    assert short[:2] == [1.0, 1.0]  # round(0.1 * 10) = 1 step of warmup
    assert warmup_clamped(ScheduleConfig(warmup_fraction=0.1), 10) is None
