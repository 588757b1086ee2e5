"""Every loader provides what the trainer uses of one (`data.loader.Loader`), with the same signatures."""

import inspect
import re

import pytest

from maester.data.loader import Loader
from maester.data.loader_base import LoaderBase
from maester.data.sft_loader import SFTLoader
from maester.data.text_loader import TextLoader
from maester.data.token_loader import TokenLoader

METHODS = [name for name, value in vars(Loader).items() if inspect.isfunction(value) and not name.startswith("_")]


def test_the_protocol_names_what_the_trainer_calls():
    import maester.train.run_start as run_start
    import maester.train.trainer as trainer

    # the loop (self.loader) and its start, resume or initialise (t.loader)
    source = inspect.getsource(trainer) + inspect.getsource(run_start)
    called = set(re.findall(r"\b(?:self|t)\.loader\.([a-z_]+)", source))
    assert called == set(METHODS) | {"batch"}, called


@pytest.mark.parametrize("cls", [TextLoader, TokenLoader, SFTLoader])
def test_each_loader_provides_the_protocol(cls):
    for name in METHODS:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        ours = list(inspect.signature(getattr(cls, name)).parameters)
        assert ours == list(inspect.signature(getattr(Loader, name)).parameters), (cls.__name__, name, ours)
    assert "batch" in inspect.signature(cls).parameters  # the BatchPlan it is built with, kept as .batch


def test_each_loader_refuses_another_kind_s_position(tmp_path):
    from tests.data import test_loader, test_sft, test_token_loader

    text = test_loader.loader(test_loader.data_cfg(test_loader.write_parquet(
        tmp_path / "t.parquet", test_loader.numbered_docs(40))))
    tokens = test_token_loader.make(test_token_loader.cfg(test_token_loader.write_indexed(
        tmp_path / "idx", [list(range(1, 40))] * 4)))
    test_sft.write_conversations(tmp_path / "c.jsonl", 20)
    sft = test_sft.loader(test_sft.data_config({"path": str(tmp_path / "c.jsonl")}))
    loaders = {"a raw-text": text, "a pre-tokenized": tokens, "an SFT": sft}
    for what, ld in loaders.items():
        assert isinstance(ld, LoaderBase) and ld.state_dict()["kind"] == ld.KIND
        ld.load_state_dict(ld.state_dict())  # its own position is taken
        for other in loaders.values():
            if other is not ld:
                with pytest.raises(ValueError, match=f"not from {what} loader"):
                    ld.load_state_dict(other.state_dict())
        with pytest.raises(ValueError, match="another seed"):
            ld.load_state_dict({**ld.state_dict(), "seed": ld.seed + 1})
