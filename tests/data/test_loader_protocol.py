"""Every loader provides what the trainer uses of one (`data.loader.Loader`), with the same signatures."""

import inspect
import re

import pytest

from maester.data.loader import Loader
from maester.data.sft import SFTLoader
from maester.data.text_stream import TextLoader
from maester.data.token_stream import TokenLoader

METHODS = [name for name, value in vars(Loader).items() if inspect.isfunction(value) and not name.startswith("_")]


def test_the_protocol_names_what_the_trainer_calls():
    import maester.train.trainer as trainer

    called = set(re.findall(r"self\.loader\.([a-z_]+)", inspect.getsource(trainer)))
    assert called == set(METHODS) | {"batch"}, called


@pytest.mark.parametrize("cls", [TextLoader, TokenLoader, SFTLoader])
def test_each_loader_provides_the_protocol(cls):
    for name in METHODS:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        ours = list(inspect.signature(getattr(cls, name)).parameters)
        assert ours == list(inspect.signature(getattr(Loader, name)).parameters), (cls.__name__, name, ours)
    assert "batch" in inspect.signature(cls).parameters  # the BatchPlan it is built with, kept as .batch
