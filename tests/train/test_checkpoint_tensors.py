"""A checkpoint holds plain tensors and values only: a tensor subclass is saved through its registered unwrap rule
(as a plain tensor that loads without the subclass's library) or the save is refused, naming the entry and its
type, before any file changes; so is a value that would pickle a class."""

from __future__ import annotations

import fractions

import pytest
import torch
from torch import nn

from maester.config import CheckpointConfig
from maester.train.checkpoint import Checkpointer
from maester.train.checkpoint_tensors import UNWRAP, qualified_name, register_unwrap


class Wrapped(torch.Tensor):
    """A wrapper subclass that keeps its weight in `inner`, as torchao's float8 weight does."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t  # noqa: E731
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return Wrapped(out) if func is torch.ops.aten.detach.default else out


def wrapped_model() -> nn.Module:
    model = nn.Linear(4, 3, bias=False)
    model.weight = nn.Parameter(Wrapped(torch.arange(12.0).reshape(3, 4)), requires_grad=False)
    return model


def test_a_subclass_without_a_rule_is_refused_before_any_file_changes(tmp_path):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    (tmp_path / "checkpoints" / "step-1.tmp").mkdir(parents=True)  # a save's leftovers, which a save would remove
    with pytest.raises(ValueError, match=r"checkpoint entry model\.weight is a tensor of type "
                                         r"tests\.train\.test_checkpoint_tensors\.Wrapped, .* no rule unwraps it"):
        checkpointer.save(1, wrapped_model(), None, {}, "{}")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1.tmp"]


def test_a_registered_rule_saves_the_plain_tensor_inside(tmp_path, monkeypatch):
    from maester.train.checkpoint_reader import load_model_weights

    monkeypatch.setitem(UNWRAP, qualified_name(Wrapped), None)  # restored after the test
    register_unwrap(Wrapped, lambda t: t.inner)
    model = wrapped_model()
    path = Checkpointer(tmp_path, CheckpointConfig()).save(1, model, None, {}, "{}")
    plain = nn.Linear(4, 3, bias=False)
    load_model_weights(path, plain)  # reads with weights_only: nothing of Wrapped was pickled
    assert torch.equal(plain.weight, model.weight.inner)
    into_wrapped = wrapped_model()
    with torch.no_grad():
        into_wrapped.weight.inner.zero_()
    load_model_weights(path, into_wrapped)  # a load into the subclass writes its inner tensor
    assert torch.equal(into_wrapped.weight.inner, model.weight.inner)


def test_a_value_that_would_pickle_a_class_is_refused(tmp_path):
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["lr"] = fractions.Fraction(1, 10)
    with pytest.raises(ValueError, match=r"checkpoint entry optimizer\.param_groups\[0\]\.lr is a "
                                         r"fractions\.Fraction, which a checkpoint cannot hold"):
        Checkpointer(tmp_path, CheckpointConfig()).save(1, model, optimizer, {}, "{}")
