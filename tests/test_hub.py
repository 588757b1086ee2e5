"""Hub ids where settings take a directory, fetched by the real `huggingface_hub` from a mock Hub on 127.0.0.1
into a cache laid out as `huggingface_hub` lays it out. Each process that reads a Hub id is a subprocess, because
`huggingface_hub` reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from maester.models.flavors import LLAMA_FLAVORS
from maester.models.hf import hf_config
from maester.models.hf_tensors import state_dict_to_hf, write_hf_tensors
from maester.models.transformer import Transformer
from maester.tools.convert import from_hf, to_hf, write_byte_tokenizer
from tests.helpers import clean_env, run_maester
from tests.hub_server import MockHub

pytest.importorskip("huggingface_hub")

RESOLVE = """
import json, sys
from maester.config import TokenizerConfig
from maester.data.tokenizers import tokenizer_path
from maester.hub import local_path
from maester.models.config import ModelConfig
try:
    out = {"config": str(local_path(sys.argv[1], "model.hf_config", "config")),
           "tokenizer": str(tokenizer_path(TokenizerConfig(kind="hf", path=sys.argv[1]))),
           "name": ModelConfig(hf_config=sys.argv[1]).name}
except ValueError as e:
    out = {"error": str(e)}
print(json.dumps(out))
"""


def hub_env(hub: MockHub | None, home: Path, **extra: str) -> dict[str, str]:
    return clean_env(**{"HF_ENDPOINT": hub.url if hub else "http://127.0.0.1:9", "HF_HOME": str(home),
                        "NO_PROXY": "127.0.0.1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                        "HF_TOKEN": "", **extra})


def resolve(value: str, env: dict[str, str], cwd: Path | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", RESOLVE, value], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def tiny_hf_files(tmp_path: Path) -> dict[str, bytes]:
    """A tiny Llama as an HF model directory: config.json, safetensors weights, a byte-level tokenizer.json."""
    args = LLAMA_FLAVORS["tiny"].model_copy(update={"vocab_size": 272})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    directory = tmp_path / "tiny-hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config("llama", args)))
    write_hf_tensors(directory, state_dict_to_hf("llama", args, model.state_dict()), 1 << 30)
    write_byte_tokenizer(directory)
    return {f.name: f.read_bytes() for f in directory.iterdir()}


@pytest.fixture
def hub(tmp_path):
    server = MockHub()
    yield server
    server.stop()


def test_a_hub_id_is_fetched_once_into_the_cache_then_read_offline(hub, tmp_path):
    files = tiny_hf_files(tmp_path)
    hub.add("org/tiny", {**files, "original/consolidated.pth": b"not fetched"})
    home = tmp_path / "hf-home"
    first = resolve("org/tiny", hub_env(hub, home))
    commit = hub.repos[("models", "org/tiny")].commit_of("main")
    snapshot = home / "hub" / "models--org--tiny" / "snapshots" / commit
    assert first == {"config": str(snapshot), "tokenizer": str(snapshot), "name": "llama"}
    assert (home / "hub" / "models--org--tiny" / "refs" / "main").read_text() == commit
    assert json.loads((snapshot / "config.json").read_text()) == json.loads(files["config.json"])
    # config only for hf_config; the tokenizer files for tokenizer.path; never the weights or subfolders
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    fetched = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
    assert sorted(fetched) == sorted(f"/org/tiny/resolve/{commit}/{f}" for f in
                                     ("config.json", "tokenizer.json", "tokenizer_config.json"))
    hub.stop()
    offline = resolve("org/tiny", hub_env(hub, home, HF_HUB_OFFLINE="1"))
    assert offline == first
    # an id pinned to a revision the cache does not hold, offline: the error names the id and how to fetch it
    missing = resolve("org/tiny@v2", hub_env(hub, home, HF_HUB_OFFLINE="1"))["error"]
    assert "model.hf_config = 'org/tiny@v2'" in missing and "HF_HUB_OFFLINE" in missing
    assert "hf download org/tiny --revision v2" in missing and "HF_HOME" in missing


def test_a_local_path_wins_and_bad_ids_are_errors_naming_key_and_id(hub, tmp_path):
    files = tiny_hf_files(tmp_path)
    hub.add("org/tiny", files)
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    for name, data in files.items():
        (local / name).write_bytes(data)
    assert resolve("org/tiny", hub_env(hub, tmp_path / "home"), cwd=tmp_path)["config"] == "org/tiny"
    assert hub.requests == []
    unknown = resolve("org/absent", hub_env(hub, tmp_path / "home"))["error"]
    assert unknown.startswith("model.hf_config = 'org/absent': no such local path") and "org/absent is not" in unknown
    revision = resolve("org/tiny@nope", hub_env(hub, tmp_path / "home"))["error"]
    assert "model.hf_config = 'org/tiny@nope'" in revision and "has no revision 'nope'" in revision
    unreachable = resolve("org/tiny", hub_env(None, tmp_path / "empty"))["error"]
    assert "org/tiny is not in the Hugging Face cache" in unreachable and "cannot be reached" in unreachable


def test_only_local_rank_0_asks_the_hub(hub, tmp_path):
    hub.add("org/tiny", tiny_hf_files(tmp_path))
    home = tmp_path / "hf-home"
    procs = [subprocess.Popen([sys.executable, "-c", RESOLVE, "org/tiny"], env=hub_env(hub, home, LOCAL_RANK=r),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ("1", "2", "0")]
    outs = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    assert outs[0] == outs[1] == outs[2] and "error" not in outs[0]
    # rank 0 asks twice (the config, then the tokenizer files); ranks 1 and 2 read the cache alone
    assert [p for m, p in hub.requests if p.endswith("/revision/main")] == ["/api/models/org/tiny/revision/main"] * 2
    assert len([p for m, p in hub.requests if m == "GET" and "/resolve/" in p]) == 3


def test_convert_from_hf_and_init_from_take_a_hub_id(hub, tmp_path):
    hub.add("org/tiny", tiny_hf_files(tmp_path))
    env = hub_env(hub, tmp_path / "hf-home")
    out = run_maester(["convert", "from-hf", "org/tiny", str(tmp_path / "ckpt")], tmp_path, env)
    assert out.returncode == 0, out.stderr
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["converted_from"] == "org/tiny"
    gen = run_maester(["generate", "org/tiny", "--prompt", "ab", "--max-new-tokens", "3"], tmp_path,
                      {**env, "HF_HUB_OFFLINE": "1"})
    assert gen.returncode == 0, gen.stderr
    bad = run_maester(["convert", "from-hf", "org/other", str(tmp_path / "x")], tmp_path, env)
    assert bad.returncode != 0 and "'org/other': no such local path" in bad.stderr


def test_to_hf_uploads_to_a_branch_with_a_model_card(hub, tmp_path):
    files = tiny_hf_files(tmp_path)
    ckpt = from_hf(tmp_path / "tiny-hf", tmp_path / "ckpt")
    env = hub_env(hub, tmp_path / "hf-home", HF_TOKEN="hf_test")
    out = run_maester(["convert", "to-hf", str(ckpt), str(tmp_path / "out"), "--upload", "me/tiny-ft",
                       "--revision", "step-0", "--base-model", "org/tiny"], tmp_path, env)
    assert out.returncode == 0, out.stderr
    repo = hub.repos[("models", "me/tiny-ft")]
    assert repo.branches["main"] == {}  # created empty; the upload went to the branch only
    uploaded = repo.branches["step-0"]
    assert uploaded["model.safetensors"] == (tmp_path / "out" / "model.safetensors").read_bytes()
    assert json.loads(uploaded["config.json"])["num_hidden_layers"] == json.loads(files["config.json"])["num_hidden_layers"]
    card = uploaded["README.md"].decode()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == "org/tiny" and meta["library_name"] == "transformers" and "maester" in meta["tags"]
    assert "`ckpt` at step 0" in card
    with pytest.raises(ValueError, match="--revision 'step-1' names the branch .* needs --upload"):
        to_hf(ckpt, tmp_path / "x", revision="step-1")
    with pytest.raises(ValueError, match="--base-model 'tiny': expected a Hub repository as ORG/NAME"):
        to_hf(ckpt, tmp_path / "x", base_model="tiny")
    assert not (tmp_path / "x").exists()


def test_a_file_name_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    from maester.hub import is_hub_id

    assert is_hub_id("Qwen/Qwen2.5-0.5B") and is_hub_id("org/name@step-400")
    for value in ("nowhere/tokenizer.json", "llama3/tokenizer.model", "enc/cl100k_base.tiktoken",
                  "org/model.safetensors"):
        assert not is_hub_id(value), value
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing local path wins
