"""RNG states in checkpoints hold no pickle: they load with weights_only=True and restore every generator; an
older pickled file is refused unless the user says it is trusted, and a crafted one never runs."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from maester.train.checkpoint_files import capture_rng_state, read_rng_state, restore_rng_state


def draws() -> tuple:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), \
        torch.rand(3).tolist()


def test_saved_state_loads_without_pickle_and_restores_every_generator(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # leaves Python's cached gaussian set
    np.random.randn()
    torch.save(capture_rng_state(), tmp_path / "rank0.pt")
    expected = draws()
    draws()
    restore_rng_state(torch.load(tmp_path / "rank0.pt", weights_only=True))
    assert draws() == expected


class Payload:
    def __reduce__(self):
        return (open, ("/tmp/maester-pickle-ran", "w"))


def test_pickled_state_is_refused_unless_trusted(tmp_path, caplog):
    old = tmp_path / "old.pt"
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, old)
    with pytest.raises(ValueError, match=r"old\.pt: the RNG state holds pickled objects.*trust_pickled_rng = true"):
        read_rng_state(old)
    with caplog.at_level(logging.WARNING, logger="maester"):
        state = read_rng_state(old, trust_pickle=True)
    assert "trust_pickled_rng" in caplog.text
    restore_rng_state(state)  # the old format still restores


def test_crafted_file_never_runs(tmp_path):
    import os

    crafted = tmp_path / "rank0.pt"
    torch.save({"torch": torch.get_rng_state(), "python": Payload()}, crafted)
    if os.path.exists("/tmp/maester-pickle-ran"):
        os.remove("/tmp/maester-pickle-ran")
    with pytest.raises(ValueError, match="pickled objects"):
        read_rng_state(crafted)
    assert not os.path.exists("/tmp/maester-pickle-ran")
