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


def truncated(size: int | None = None):
    """model.safetensors cut to `size` bytes (half its length when None: the header whole, the data short)."""
    def damage(path):
        file = path / "model.safetensors"
        with open(file, "r+b") as f:
            f.truncate(size if size is not None else file.stat().st_size // 2)
    return damage


def header_bomb(path):
    """A header length of 2^62 bytes: refused from the 8 bytes, never allocated."""
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + data[8:])


def bad_tokenizer(path):
    (path / "tokenizer.json").write_text("{bad")


# case -> (damage to a good HF directory, text stderr must hold after "<dir>/", commands that meet it)
BOTH = ("convert", "generate")
CASES = {
    "H1 wrong-shaped tensor": (reshaped("model.layers.0.self_attn.q_proj.weight", 63),
                               "model.safetensors: model.layers.0.self_attn.q_proj.weight has shape [63, 64], but "
                               "{dir}/config.json implies [64, 64]", BOTH),
    "H6 required key missing": (edit_config(num_hidden_layers=None), "config.json: no num_hidden_layers", BOTH),
    "H7 wrong type": (edit_config(num_hidden_layers="two"),
                      "config.json: num_hidden_layers = 'two': must be a positive integer", BOTH),
    "H7 negative": (edit_config(num_hidden_layers=-1),
                    "config.json: num_hidden_layers = -1: must be a positive integer", BOTH),
    "H7 a bad float": (edit_config(rms_norm_eps="tiny"), "config.json: rms_norm_eps = 'tiny': ", BOTH),
    "H7 a bad RoPE value": (edit_config(rope_parameters={"rope_type": "linear", "factor": "big",
                                                         "rope_theta": 10000.0}),
                            "config.json: rope_parameters.factor = 'big': ", BOTH),
    "H8 vocab_size disagrees with the tensors": (edit_config(vocab_size=1000),
                                                 "model.safetensors: model.embed_tokens.weight has shape [320, 64], "
                                                 "but {dir}/config.json implies [1000, 64] (vocab_size = 1000", BOTH),
    "H9 truncated header": (truncated(1000), "model.safetensors: not a readable safetensors file (", BOTH),
    "H9 truncated data": (truncated(), "model.safetensors: not a readable safetensors file (", BOTH),
    "H9 header-length bomb": (header_bomb, "model.safetensors: not a readable safetensors file (", BOTH),
    "H10 bad tokenizer.json": (bad_tokenizer, "tokenizer.json: not a tokenizer.json the tokenizers library reads",
                               ("convert",)),  # generate reads it in place: named right before
}


@pytest.mark.parametrize("case,command", [(case, command) for case, (_, _, commands) in CASES.items()
                                          for command in commands])
def test_bad_hf_directory_is_one_line(good, tmp_path, case, command):
    path = tmp_path / "hf"
    shutil.copytree(good, path)
    damage, expected, _ = CASES[case]
    damage(path)
    args = (["convert", "from-hf", str(path), str(tmp_path / "out")] if command == "convert" else
            ["generate", str(path), "--prompt", "hi", "--max-new-tokens", "2"])
    out = run_maester(args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "pydantic.dev" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith(f"maester {command}: error: ")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert f"{path}/{expected.format(dir=path)}" in lines[0], out.stderr[-3000:]
    assert ".tmp" not in lines[0]  # named by the source, never by convert's temporary output directory
    assert not (tmp_path / "out").exists()
