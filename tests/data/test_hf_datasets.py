"""Data sources on the Hugging Face Hub (`hf://datasets/org/name[@rev]/<glob or dir>`), read by the real
`huggingface_hub` from a mock Hub on 127.0.0.1, against the same Parquet files read locally: the same batches,
validation split and exact resume; a moved revision is a resume error; offline, an error saying how to fetch the
files; `maester data download` writes them for a cluster without internet. What reads the Hub runs in a new
process (a fork of one that has not imported `huggingface_hub`), because it reads HF_ENDPOINT and HF_HUB_OFFLINE
when it is imported."""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import run_code, run_maester
from tests.hub_server import MockHub
from tests.test_hub import hub_env

pytest.importorskip("huggingface_hub")

WORDS = "the cat sat on a mat while every dog ran far away from home and back again".split()

# Builds a loader per run of the JSON spec in argv[1] and prints, per run, the rows of its steps, its validation
# rows, and its state after `save_after` steps (or the error it raised).
LOADERS = """
import json, sys
from maester.config import DataConfig, TokenizerConfig
from maester.data.batch import BatchPlan
from maester.data.loader import build_loader
from maester.data.tokenizers import ByteTokenizer

def rows(batches):
    return [b.input_ids.tolist() + b.labels.tolist() for b in batches]

out = []
for run in json.loads(sys.argv[1]):
    try:
        data = DataConfig(**run["data"])
        ld = build_loader(data, TokenizerConfig(kind="byte"), ByteTokenizer(), seed=3, batch=BatchPlan(4, 2, 1, 0))
        if run.get("state"):
            ld.load_state_dict(json.loads(open(run["state"]).read()))
        steps, state = [], None
        for i in range(run["steps"]):
            if i == run.get("save_after"):
                state = json.loads(json.dumps(ld.state_dict()))
            steps.append(rows(ld.next_step()))
        ld.close()
        out.append({"steps": steps, "validation": rows(ld.validation_batches(2)), "state": state})
    except ValueError as e:
        out.append({"error": str(e)})
print(json.dumps(out), flush=True)
# Printed: leave without the interpreter's teardown, which under load now and then aborted a process that had
# finished ("terminate called without an active exception"; twice in some 150 runs, under the parallel suite).
import os
os._exit(0)
"""

RESOLVE = """
import json, sys
from maester.config import DataSourceConfig
from maester.data.text_files import resolve_files
try:
    files = resolve_files(DataSourceConfig(path=sys.argv[1]))
    print(json.dumps({"files": [str(f) for f in files], "commits": sorted({f.commit for f in files}),
                      "keys": [f.key_name for f in files]}))
except (ValueError, FileNotFoundError) as e:
    print(json.dumps({"error": str(e)}))
"""


def parquet_bytes(texts: list, row_group_size: int, column: str = "text") -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), buf, row_group_size=row_group_size)
    return buf.getvalue()


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"doc{seed}-{i} " + " ".join(rng.choices(WORDS, k=rng.randint(2, 30))) for i in range(n)]


def shards() -> dict[str, bytes]:
    """A dataset repository: Parquet shards in data/ with several row groups, and what is not data."""
    return {"data/train-00001.parquet": parquet_bytes(documents(37, 1), 10),
            "data/train-00000.parquet": parquet_bytes(documents(50, 0), 16),
            "data/extra/train-00002.parquet": parquet_bytes(documents(12, 2), 5),
            "README.md": b"# a dataset\n", ".gitattributes": b"*.parquet filter=lfs\n"}


def write_local(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


# A fork of the worker's zygote (which imports torch and maester, not huggingface_hub) imports it afresh, under the
# fork's own environment: what a new process does.
FRESH = "import sys\nassert 'huggingface_hub' not in sys.modules, 'imported before the environment was set'\n"


def run_python(script: str, arg: str, env: dict) -> list | dict:
    """`python -c SCRIPT ARG` with `env`: a fork (`helpers.run_code`) or a real process."""
    out = run_code(FRESH + script, [arg], env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def loaders(runs: list[dict], env: dict) -> list[dict]:
    return run_python(LOADERS, json.dumps(runs), env)


def pretrain(path: str, steps: int = 4, **kw) -> dict:
    source = {"path": path, "validation_fraction": 0.2}
    return {"data": {"sources": [source], "seq_len": 24, "chunk_documents": 8, "num_workers": kw.pop("workers", 0)},
            "steps": steps, **kw}


@pytest.fixture
def hub():
    server = MockHub()
    yield server
    server.stop()


def test_a_hub_source_resolves_to_its_sorted_data_files_at_the_commit_of_its_revision(hub, tmp_path):
    repo = hub.add("org/web", shards(), kind="datasets")
    commit = repo.commit_of("main")
    env = hub_env(hub, tmp_path / "home")
    glob = run_python(RESOLVE, "hf://datasets/org/web/data/*.parquet", env)
    assert glob == {"files": ["hf://datasets/org/web/data/train-00000.parquet",
                              "hf://datasets/org/web/data/train-00001.parquet"],
                    "commits": [commit], "keys": ["train-00000.parquet", "train-00001.parquet"]}
    # a directory: its data files at any depth, named relative to it (as a local directory's); README and hidden
    # files are not data
    directory = run_python(RESOLVE, f"hf://datasets/org/web@{commit}", env)
    assert directory["keys"] == ["data/extra/train-00002.parquet", "data/train-00000.parquet",
                                 "data/train-00001.parquet"]
    assert directory["files"][0] == f"hf://datasets/org/web@{commit}/data/extra/train-00002.parquet"
    assert not [p for p, _ in hub.reads]  # listing reads no file
    missing = run_python(RESOLVE, "hf://datasets/org/web/nothing/*.parquet", env)["error"]
    assert "hf://datasets/org/web/nothing/*.parquet" in missing and "matches no files" in missing
    hub.add("org/jsonl", {"a.jsonl": b'{"text": "x"}\n'}, kind="datasets")
    jsonl = run_python(RESOLVE, "hf://datasets/org/jsonl", env)["error"]
    assert "hf://datasets/org/jsonl/a.jsonl" in jsonl and "only Parquet" in jsonl
    assert "maester data download hf://datasets/org/jsonl --output DIR" in jsonl
    unknown = run_python(RESOLVE, "hf://datasets/org/nope/*.parquet", env)["error"]
    assert "org/nope is not a dataset repository" in unknown
    assert "spelled hf://datasets/org/name" in run_python(RESOLVE, "hf://models/org/web", env)["error"]


def test_training_from_the_hub_reads_what_the_same_files_give_locally_by_byte_ranges(hub, tmp_path):
    files = shards()
    hub.add("org/web", files, kind="datasets")
    local = write_local(tmp_path / "local", files)
    from_hub, from_disk = loaders([pretrain("hf://datasets/org/web/data/*.parquet"),
                                   pretrain(f"{local}/data/*.parquet")], hub_env(hub, tmp_path / "home"))
    assert from_hub["steps"] == from_disk["steps"] and len(from_hub["steps"]) == 4
    assert from_hub["validation"] == from_disk["validation"] and from_hub["validation"]
    # Parquet footers and row groups by range, never a whole file; nothing written to the cache
    assert hub.reads and all(r is not None and r.startswith("bytes=") for _, r in hub.reads)
    assert not list((tmp_path / "home").rglob("*.parquet"))


def test_a_hub_source_mixes_with_a_local_one_as_its_local_copy_does(hub, tmp_path):
    files = shards()
    hub.add("org/web", files, kind="datasets")
    local = write_local(tmp_path / "local", files)
    other = write_local(tmp_path / "other", {"docs.parquet": parquet_bytes(documents(40, 7), 8)}) / "docs.parquet"

    def mixed(path: str) -> dict:
        run = pretrain(path)
        run["data"]["sources"] = [{"path": path, "weight": 3.0, "validation_fraction": 0.2},
                                  {"path": str(other), "weight": 1.0}]
        return run

    from_hub, from_disk = loaders([mixed("hf://datasets/org/web/data/*.parquet"), mixed(f"{local}/data/*.parquet")],
                                  hub_env(hub, tmp_path / "home"))
    assert from_hub["steps"] == from_disk["steps"] and len(from_hub["steps"]) == 4
    assert from_hub["validation"] == from_disk["validation"]


def test_a_resume_from_the_hub_is_exact_and_a_moved_revision_is_an_error_naming_both_commits(hub, tmp_path):
    repo = hub.add("org/web", shards(), kind="datasets")
    first = repo.commit_of("main")
    env = hub_env(hub, tmp_path / "home")
    path = "hf://datasets/org/web/data/*.parquet"
    (whole,) = loaders([pretrain(path, steps=6, save_after=3, workers=1)], env)  # in a worker process, too
    state = tmp_path / "state.json"
    state.write_text(json.dumps(whole["state"]))
    (resumed,) = loaders([pretrain(path, steps=3, state=str(state))], env)
    assert resumed["steps"] == whole["steps"][3:]
    assert whole["state"]["commits"] == {path: first}

    now = repo.update("main", {"data/train-00001.parquet": parquet_bytes(documents(37, 9), 10)})
    moved, pinned = loaders([pretrain(path, steps=3, state=str(state)),
                             pretrain(f"hf://datasets/org/web@{first}/data/*.parquet", steps=3, state=str(state))], env)
    assert now != first
    assert first in moved["error"] and now in moved["error"] and path in moved["error"]
    assert f"hf://datasets/org/web@{first}/data/*.parquet" in moved["error"]  # how to resume on the data trained on
    assert pinned.get("steps") == whole["steps"][3:], pinned


def test_offline_or_without_huggingface_hub_the_error_names_the_source_and_how_to_fetch_it(hub, tmp_path):
    hub.add("org/web", shards(), kind="datasets")
    offline = run_python(RESOLVE, "hf://datasets/org/web/data/*.parquet",
                         hub_env(hub, tmp_path / "home", HF_HUB_OFFLINE="1"))["error"]
    assert "hf://datasets/org/web/data/*.parquet" in offline and "HF_HUB_OFFLINE is set" in offline
    assert "`maester data download hf://datasets/org/web/data/*.parquet --output DIR`" in offline
    assert "'DIR/data/*.parquet'" in offline
    assert not hub.requests
    unreachable = run_python(RESOLVE, "hf://datasets/org/web/data", hub_env(None, tmp_path / "home"))["error"]
    assert "the Hub cannot be reached" in unreachable and "--output DIR" in unreachable
    without = run_python("import sys; sys.modules['huggingface_hub'] = None\n" + RESOLVE, "hf://datasets/org/web",
                         hub_env(hub, tmp_path / "home"))["error"]
    assert "huggingface_hub" in without and "maester[hub]" in without and "hf://datasets/org/web" in without


def test_data_download_writes_the_files_whole_with_a_manifest_and_trains_as_the_hub_source(hub, tmp_path):
    files = shards()
    repo = hub.add("org/web", files, kind="datasets")
    commit = repo.commit_of("main")
    env = hub_env(hub, tmp_path / "home")
    out = tmp_path / "offline"
    # a file that a stopped run finished is kept; the others are fetched
    write_local(out / ".partial-download", {"data/train-00000.parquet": files["data/train-00000.parquet"]})
    done = run_maester(["data", "download", "hf://datasets/org/web/data/*.parquet", "--output", str(out)], tmp_path,
                       env)
    assert done.returncode == 0, done.stderr
    assert "files=2 fetched=1" in done.stdout and f"commit={commit}" in done.stdout
    assert f"source='{out}/data/*.parquet'" in done.stdout
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        ".download.json", "data/train-00000.parquet", "data/train-00001.parquet"]
    for name in ("data/train-00000.parquet", "data/train-00001.parquet"):
        assert (out / name).read_bytes() == files[name]
    manifest = json.loads((out / ".download.json").read_text())
    assert manifest["repo"] == "org/web" and manifest["commit"] == commit and manifest["revision"] == "main"
    assert manifest["files"][1] == {"path": "data/train-00001.parquet", "size": len(files["data/train-00001.parquet"]),
                                    "sha256": hashlib.sha256(files["data/train-00001.parquet"]).hexdigest()}
    assert [p for p, _ in hub.reads] == ["data/train-00001.parquet"]

    again = run_maester(["data", "download", "hf://datasets/org/web/data/*.parquet", "--output", str(out)], tmp_path,
                        env)
    assert again.returncode == 0 and "fetched=0" in again.stdout
    other = run_maester(["data", "download", "hf://datasets/org/web", "--output", str(out)], tmp_path, env)
    assert other.returncode != 0 and "holds another download" in other.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    busy = run_maester(["data", "download", "hf://datasets/org/web/data", "--output", str(tmp_path / "busy")],
                       tmp_path, env)
    assert busy.returncode != 0 and "is not empty (notes.txt)" in busy.stderr

    (from_hub,) = loaders([pretrain("hf://datasets/org/web/data/*.parquet")], env)
    (downloaded,) = loaders([pretrain(f"{out}/data/*.parquet")], hub_env(None, tmp_path / "home", HF_HUB_OFFLINE="1"))
    assert from_hub["steps"] == downloaded["steps"] and from_hub["validation"] == downloaded["validation"]


def test_sft_conversations_from_the_hub_are_those_of_the_same_file_locally(hub, tmp_path):
    rng = random.Random(0)
    convs = [json.dumps([{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))},
                         {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))}])
             for _ in range(40)]
    files = {"chats.parquet": parquet_bytes(convs, 16, column="messages")}
    hub.add("org/chats", files, kind="datasets")
    local = write_local(tmp_path / "local", files)

    def sft(path: str) -> dict:
        return {"data": {"mode": "sft", "sources": [{"path": path, "validation_fraction": 0.1}], "seq_len": 160},
                "steps": 3}

    from_hub, from_disk = loaders([sft("hf://datasets/org/chats/chats.parquet"), sft(f"{local}/chats.parquet")],
                                  hub_env(hub, tmp_path / "home"))
    assert "error" not in from_hub, from_hub
    assert from_hub["steps"] == from_disk["steps"] and from_hub["validation"] == from_disk["validation"]
