"""A damaged or inconsistent Hugging Face directory is one line naming the file (and the config key or tensor), exit
2, for `convert from-hf` and `generate` alike: never a traceback (probe cases H1, H6-H10)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from tests.helpers import run_maester
from tests.models.test_hf_parity import random_hf_model, tiny_args
from tests.tools.test_convert import CONTEXT

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from maester.tools.convert import write_byte_tokenizer

    name, args = tiny_args("llama")
    path = tmp_path_factory.mktemp("hf") / "good"
    random_hf_model(name, args.model_copy(update={"max_seq_len": CONTEXT}), seed=3).save_pretrained(path)
    write_byte_tokenizer(path, CONTEXT)
    return path


def edit_config(**changes):
    def damage(path):
        config = json.loads((path / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (path / "config.json").write_text(json.dumps(config))
    return damage


def reshaped(key: str, rows: int):
    def damage(path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        tensors[key] = tensors[key][:rows].clone()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return damage


def truncated(path):
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(1000)


def header_bomb(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + data[8:])


CASES = {
    "H1 wrong-shaped tensor": (reshaped("model.layers.0.self_attn.q_proj.weight", 7),
                               "model.layers.0.self_attn.q_proj.weight has shape [7, "),
    "H6 required key missing": (edit_config(num_hidden_layers=None), "config.json: no num_hidden_layers"),
    "H7 wrong type": (edit_config(num_hidden_layers="two"), "config.json: num_hidden_layers = 'two': must be a "
                                                            "positive integer"),
    "H7 negative": (edit_config(num_hidden_layers=-1), "config.json: num_hidden_layers = -1: must be"),
    "H7 a bad float": (edit_config(rms_norm_eps="tiny"), "config.json: norm_eps = 'tiny'"),
    "H8 vocab_size disagrees with the tensors": (edit_config(vocab_size=1000), "(its vocab_size is 1000; the "
                                                                               "tensor has"),
    "H9 truncated safetensors": (truncated, "model.safetensors: not a readable safetensors file"),
    "H9 header-length bomb": (header_bomb, "model.safetensors: not a readable safetensors file"),
}


RUNS = [(case, "convert") for case in CASES] + [(case, "generate") for case in (
    "H1 wrong-shaped tensor", "H6 required key missing", "H7 a bad float", "H9 truncated safetensors")]


@pytest.mark.parametrize("case,command", RUNS)
def test_bad_hf_directory_is_one_line(good, tmp_path, case, command):
    path = tmp_path / "hf"
    shutil.copytree(good, path)
    damage, expected = CASES[case]
    damage(path)
    args = (["convert", "from-hf", str(path), str(tmp_path / "out")] if command == "convert" else
            ["generate", str(path), "--prompt", "hi", "--max-new-tokens", "2"])
    out = run_maester(args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "pydantic.dev" not in out.stderr, out.stderr[-3000:]
    assert str(path) in out.stderr and expected in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_bad_tokenizer_json_is_named_by_its_source(good, tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(good, path)
    (path / "tokenizer.json").write_text("{bad")
    out = run_maester(["convert", "from-hf", str(path), str(tmp_path / "out")], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"{path}/tokenizer.json" in out.stderr and ".tmp" not in out.stderr, out.stderr[-3000:]
