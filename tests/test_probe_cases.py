"""The reliability probe of bdbdced, kept as a table so that what holds stays held: each case is the probe's
command (its id in the name) with the exit code and the text a user must see. The cases that failed then have
their own tests, listed in `FIXED_ELSEWHERE`; the Reliability section of docs/checkpoints.md counts both."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from maester.data.indexed import IndexedDatasetWriter
from maester.train.metrics_file import read_events, read_metrics
from tests.helpers import (DEMO_CONFIG, clean_env, rewrite_manifest, run_maester, seed_job, tiny_overrides,
                           write_corpus)

DEMO = str(DEMO_CONFIG)


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """The probe's scratch files."""
    d = tmp_path_factory.mktemp("probe")
    (d / "bad.toml").write_text('[job]\nname = "x\n')
    (d / "bad.yaml").write_text("job:\n  name: [x\n")
    (d / "bad.json").write_text('{"job": {"name": "x",}}')
    (d / "empty.toml").write_text("")
    (d / "empty.yaml").write_text("")
    (d / "empty.json").write_text("")
    (d / "unk.toml").write_text("[foo]\nbar = 1\n")
    (d / "evil.yaml").write_text(f"job: !!python/object/apply:os.system ['touch {d}/PWNED_yaml']\n")
    (d / "empty.jsonl").write_text("")
    (d / "good.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    write_corpus(d / "corpus.parquet")
    (d / "trunc.parquet").write_bytes((d / "corpus.parquet").read_bytes()[:500])
    with IndexedDatasetWriter(d / "mism", np.uint16) as w:
        for i in range(300):
            w.add_document(np.arange(10) % 200)
    idx = (d / "mism.idx").read_bytes()
    (d / "mism.idx").write_bytes(idx[:60])
    with IndexedDatasetWriter(d / "short", np.uint16) as w:
        w.add_document(np.arange(1000) % 200)
    (d / "short.bin").write_bytes((d / "short.bin").read_bytes()[:200])
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 7
    (d / "chat_noasst.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats) + json.dumps(
        {"messages": [{"role": "user", "content": "only a question"}]}) + "\n")
    (d / "chat_bogus.jsonl").write_text(json.dumps(
        {"messages": [{"role": "bogus", "content": "x"}, {"role": "assistant", "content": "y"}]}) + "\n")
    (d / "chat_norole.jsonl").write_text(json.dumps({"messages": [{"content": "x"}]}) + "\n")
    (d / "chat_null.jsonl").write_text(json.dumps(
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}) + "\n")
    (d / "jobs" / "rep").mkdir(parents=True)
    (d / "jobs" / "rep" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\ngarbage line\n'
                                                      '{"step": 2, "loss": 1.0}\n')
    (d / "jobs" / "rep" / "config.json").write_text("{}")
    return d


def train(d, *extra):
    return ["train", DEMO, *tiny_overrides(d / "corpus.parquet", d / "jobs", "t", training__steps=2), *extra]


def source(path) -> str:
    return f'--data.sources=[{{"path":"{path}"}}]'


def sft(d, path) -> list[str]:
    return train(d, "--data.mode=sft", "--data.seq_len=128", source(path))


# id -> (command given the scratch directory, exit code, text the output must hold)
HOLDS = {
    "C1 malformed TOML": (lambda d: ["config", "show", str(d / "bad.toml")], 2, "bad.toml: cannot parse"),
    "C2 malformed YAML": (lambda d: ["config", "show", str(d / "bad.yaml")], 2, "bad.yaml"),
    "C3 malformed JSON": (lambda d: ["config", "show", str(d / "bad.json")], 2, "bad.json"),
    "C5 empty TOML": (lambda d: ["config", "show", str(d / "empty.toml")], 0, '"job"'),
    "C5 empty YAML": (lambda d: ["config", "show", str(d / "empty.yaml")], 0, '"job"'),
    "C5 empty JSON": (lambda d: ["config", "show", str(d / "empty.json")], 2, "empty.json"),
    "C7 zero steps": (lambda d: ["config", "show", DEMO, "--training.steps=0"], 2, "training.steps"),
    "C7 negative lr": (lambda d: ["config", "show", DEMO, "--optimizer.lr=-1"], 2, "optimizer.lr"),
    "C7 lr nan": (lambda d: ["config", "show", DEMO, "--optimizer.lr=nan"], 2, "optimizer.lr"),
    "C7 zero batch": (lambda d: ["config", "show", DEMO, "--training.global_batch_size=0"], 2,
                      "training.global_batch_size"),
    "C7 zero seq_len": (lambda d: ["config", "show", DEMO, "--data.seq_len=0"], 2, "data.seq_len"),
    "C7 keep_last 0": (lambda d: ["config", "show", DEMO, "--checkpoint.keep_last=0"], 2, "checkpoint.keep_last"),
    "C7 no sources": (lambda d: ["config", "show", DEMO, "--data.sources=[]"], 2, "data.sources"),
    "C10 unknown section": (lambda d: ["config", "show", str(d / "unk.toml")], 2, "foo: unknown key"),
    "C11 stray env var": (lambda d: ["config", "show", DEMO, "--env", "MAESTER_FOO=1"], 2, "MAESTER_FOO"),
    "C12 override with bad JSON": (lambda d: ["config", "show", DEMO, '--data.sources=[{"path": "x",}]'], 2,
                                   "data.sources"),
    "C13 override into an index": (lambda d: ["config", "show", DEMO, "--training.steps.foo=3"], 2,
                                   "training.steps"),
    "C14 config is a directory": (lambda d: ["train", str(d)], 2, "not a job directory"),
    "C15 YAML python tag": (lambda d: ["config", "show", str(d / "evil.yaml")], 2, "evil.yaml"),
    "C16 zero layers": (lambda d: ["config", "show", DEMO, '--model.overrides={"n_layers": 0}'], 2, "n_layers"),
    "D1 empty JSONL": (lambda d: train(d, source(d / "empty.jsonl")), 2, "holds no documents"),
    "D2 empty JSONL tokenized": (lambda d: ["data", "tokenize", str(d / "empty.jsonl"), "--output-prefix",
                                            str(d / "dt" / "a"), "--tokenizer", "byte"], 0, "documents=0"),
    "D6 Parquet cut in half": (lambda d: train(d, source(d / "trunc.parquet")), 2, "not a readable Parquet file"),
    "D9 .idx truncated": (lambda d: train(d, source(d / "mism")), 2, "mism.idx: truncated"),
    "D10 .bin shorter than the index": (lambda d: train(d, source(d / "short")), 2, "short.bin"),
    "D13 glob matches nothing": (lambda d: train(d, source(d / "nomatch*.jsonl")), 2, "nomatch"),
    "D14 source weight 0": (lambda d: train(d, f'--data.sources=[{{"path":"{d / "good.jsonl"}","weight":0}}]'),
                            2, "data.sources.0.weight"),
    "D15 no assistant turn": (lambda d: sft(d, d / "chat_noasst.jsonl"), 2, "chat_noasst.jsonl:8"),
    "D16 bogus role": (lambda d: sft(d, d / "chat_bogus.jsonl"), 2, "bogus"),
    "D17 message without role": (lambda d: sft(d, d / "chat_norole.jsonl"), 2, "chat_norole.jsonl:1"),
    "D17 null content": (lambda d: sft(d, d / "chat_null.jsonl"), 2, "chat_null.jsonl:1"),
    "S4 hostile job name": (lambda d: ["submit", DEMO, f"--job.dump_dir={d}/sub", "--no-submit",
                                       "--name=$(touch pwned)"], 2, "may only contain"),
    "S5 traversal job name": (lambda d: ["submit", DEMO, f"--job.dump_dir={d}/sub", "--no-submit",
                                         "--name=../../etc"], 2, "may only contain"),
    "X5 garbage metrics line": (lambda d: ["report", str(d / "jobs" / "rep")], 2, "metrics.jsonl:2: not valid JSON"),
}

# The cases that failed on bdbdced, and the tests that now hold them.
FIXED_ELSEWHERE = {
    "C4 C8 C9 C17 K7 K14 K15 X3 X4 X6": "tests/test_error_table.py",
    "D4 D7": "tests/test_cli.py::test_invalid_utf8_in_a_loader_worker_is_one_line, tests/test_error_table.py",
    "D11 D12": "tests/data/test_token_ids.py",
    "K1 K2 K3 K4 K6 K10 K11 K13": "tests/train/test_damaged_checkpoints.py",
    "S1": "tests/train/test_rng_state.py",
    "S2": "tests/train/test_crafted_checkpoints.py",
    "P1 P2": "tests/jobs/test_job_lock.py",
    "G2": "tests/train/test_group_sigterm.py",
    "G6 G7 X1(data tools)": "tests/tools/test_temp_files.py",
    "X2": "tests/jobs/test_job_lock.py::test_training_from_another_directory_keeps_the_scripts_workdir",
}


@pytest.mark.parametrize("case", HOLDS)
def test_probe_case_holds(d, tmp_path, case):
    command, code, expected = HOLDS[case]
    args = command(d)
    if "--env" in args:  # C11: the variable goes into the environment, not the command line
        from tests.helpers import clean_env

        i = args.index("--env")
        name, value = args[i + 1].split("=", 1)
        out = run_maester(args[:i] + args[i + 2:], cwd=tmp_path, env=clean_env(**{name: value}))
    else:
        out = run_maester(args, cwd=tmp_path)
    assert out.returncode == code, (out.stdout + out.stderr)[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert expected in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    assert not (d / "PWNED_yaml").exists()


# ------------------------------------------------------------------------------------------------------------------
# The re-probe of 050c130: its 23 cases that fell short, each a row with the answer a user must now get. The rows run
# the command in this process (`maester.cli.main`: the real command, without a new interpreter's start-up) unless
# they need one of their own (a Hub endpoint read at import, a read-only mount). Every row that refuses is checked
# to leave the files it was given as they were (logs/*.log aside: the record of the attempt).

@dataclass
class Row:
    command: Callable[["Scratch"], list[str]]
    """Prepares the case's files in its scratch and returns the command line."""
    code: int
    text: str
    env: dict[str, str] = field(default_factory=dict)
    own_process: bool = False
    refusal: bool = True
    """A non-zero `code` is a refusal, which must change no file; False: a run that failed on its way."""
    then: Callable[["Scratch"], None] | None = None
    """A further check on the files after the command (for the rows that do not refuse)."""


class Scratch:
    """A case's own directory, with copies of the module's jobs and data (`base`)."""

    def __init__(self, root: Path, base: Path):
        self.root, self.base = root, base
        self.holders: list[subprocess.Popen] = []

    def job(self, name: str = "small", new: str | None = None) -> Path:
        target = self.root / "jobs" / (new or name)
        shutil.copytree(self.base / "jobs" / name, target, symlinks=True)
        return target

    def hold(self, job: Path, holder: bytes = b'{"host": "node7", "pid": 4242}') -> None:
        """Another process holds the job's lock (a running trainer), with `holder` in run.lock."""
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(job / "run.lock"), holder.decode()],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "locked"
        self.holders.append(proc)


HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.pwrite(fd, sys.argv[2].encode(), 0)
print("locked", flush=True)
sys.stdin.read()
"""


def flip_exponent_bit(checkpoint: Path) -> None:
    """One flipped bit, same size: the high exponent bit of the float32 in the middle of the largest shard."""
    shard = max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[(len(data) // 2) // 4 * 4 + 3] ^= 0x40
    shard.write_bytes(data)


def craft_metadata(checkpoint: Path, other: Path) -> None:
    """`.metadata` of DCP's own classes whose embedding storage names a file of another checkpoint."""
    from maester.train.checkpoint_files import _MetadataUnpickler

    with open(checkpoint / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == "model.tok_embeddings.weight":
            metadata.storage_data[index] = dataclasses.replace(
                info, relative_path=os.path.relpath(other / "__0_0.distcp", checkpoint))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(checkpoint)


def add_to_manifest(checkpoint: Path, name: str, entry: dict) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = entry
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def as_llama(s: Scratch) -> Path:
    """A copy of the qwen3 job whose checkpoint's config.json says llama, its manifest made to match."""
    job = s.job("qwen", "asllama")
    step = job / "checkpoints" / "step-0"
    cfg = json.loads((step / "config.json").read_text())
    cfg["model"]["name"] = "llama"
    (step / "config.json").write_text(json.dumps(cfg))
    rewrite_manifest(step)
    return job


def sft_pair(s: Scratch, name: str, labels_of) -> str:
    """An indexed SFT pair of 6 byte-token sequences; `labels_of(tokens)` gives each sequence's aligned labels."""
    from maester.data.sft_indexed import DTYPE

    prefix = s.root / "sft" / name
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(f"{prefix}_text_document", DTYPE) as tw, \
            IndexedDatasetWriter(f"{prefix}_label_document", DTYPE) as lw:
        for i in range(6):
            tokens = np.array(list(f"question {i}? answer {i}.".encode()), dtype=DTYPE)
            tw.add_document(tokens)
            lw.add_document(labels_of(tokens).astype(DTYPE))
    return f"{prefix}_text_document"


def trained_answers(tokens: np.ndarray) -> np.ndarray:
    labels = np.full(len(tokens), -100)
    labels[12:] = tokens[12:]
    return labels


def slurm_record(job: Path, *lines: str) -> Path:
    (job / "slurm_jobs.jsonl").write_text(json.dumps({"job_id": "22", "event": "submit"}) + "\n"
                                          + "".join(line + "\n" for line in lines))
    return job


def small(s: Scratch, *extra: str) -> list[str]:
    """`train` of the module's corpus under the scratch's jobs/ (new jobs)."""
    return ["train", DEMO, *tiny_overrides(s.base / "corpus.parquet", s.root / "jobs", "new", training__steps=2,
                                           checkpoint__interval=0), *extra]


def download_copy(s: Scratch) -> Path:
    out = s.root / "dl"
    shutil.copytree(s.base / "dl", out)
    changed = out / "data" / "train-1.parquet"
    data = changed.read_bytes()
    changed.write_bytes(data.replace(b"python", b"PYTHON"))  # same size, still Parquet, other text
    assert len(changed.read_bytes()) == len(data) and changed.read_bytes() != data
    return out


def lock_dir(s: Scratch) -> list[str]:
    job = s.job()
    (job / "run.lock").unlink(missing_ok=True)
    (job / "run.lock").mkdir()
    return ["train", str(job), "--training.steps=4"]


def symlinked_step(s: Scratch) -> list[str]:
    job = s.job()
    archive = s.root / "archive" / "step-1"
    archive.parent.mkdir()
    shutil.move(job / "checkpoints" / "step-1", archive)
    (job / "checkpoints" / "step-1").symlink_to(archive)
    return ["train", str(job), "--training.steps=4", "--checkpoint.keep_last=1", "--checkpoint.interval=1"]


def symlink_removed_archive_kept(s: Scratch) -> None:
    steps = s.root / "jobs" / "small" / "checkpoints"
    assert not (steps / "step-1").exists() and not (steps / "step-1").is_symlink()
    assert (s.root / "archive" / "step-1" / ".metadata").is_file()
    assert sorted(p.name for p in steps.iterdir()) == ["latest", "step-4"]


def resumed_past_the_damage(s: Scratch) -> None:
    steps = s.root / "jobs" / "small" / "checkpoints"
    assert (steps / "step-3.damaged").is_dir() and (steps / "step-5").is_dir()
    job = s.root / "jobs" / "small"
    assert [e["checkpoint"] for e in read_events(job) if e["event"] == "checkpoint_damaged"] == ["step-3"]
    trained = [e for e in read_metrics(job / "metrics.jsonl") if e["step"] >= 3]
    assert [e["step"] for e in trained] == [3, 4, 5] and all(e["grad_norm"] > 0 for e in trained)  # a live model


def nothing_saved_after_the_damage(s: Scratch) -> None:
    """The checkpoints saved after the damaged one are set aside, no older one was deleted, and `latest` points at
    the one loaded (which the error names)."""
    steps = s.root / "jobs" / "small" / "checkpoints"
    names = sorted(p.name for p in steps.iterdir())
    assert names[:4] == ["latest", "step-1", "step-2", "step-3"] and all(n.endswith(".damaged") for n in names[4:])
    assert os.readlink(steps / "latest") == "step-3"


def exported_with_chat_template(s: Scratch) -> None:
    """The export carries the job's built-in template (chatml) in tokenizer_config.json."""
    template = json.loads((s.root / "hf" / "tokenizer_config.json").read_text()).get("chat_template", "")
    assert "<|im_start|>" in template, template


def submitted_without_config_change(s: Scratch) -> None:
    assert (s.root / "jobs" / "pfx" / "config.json").is_file()


PROBE_2 = {
    "N6 a Hub glob matching nothing": Row(
        lambda s: ["data", "download", "hf://datasets/org/ds/nomatch/*.parquet", "--output", str(s.root / "o")],
        2, "the pattern matches no files", own_process=True),
    "N9 a swapped file in a download, downloaded again": Row(
        lambda s: ["data", "download", "hf://datasets/org/ds/data", "--output", str(download_copy(s))], 2,
        "train-1.parquet is not the file that was downloaded", own_process=True),
    "N9 a swapped file in a download, trained on": Row(
        lambda s: small(s, source(download_copy(s) / "data")), 2,
        "train-1.parquet is not the file that was downloaded"),
    "N17 indexed SFT whose labels are all -100": Row(
        lambda s: small(s, "--data.mode=sft", "--data.seq_len=64",
                        source(sft_pair(s, "allm", lambda t: np.full(len(t), -100)))), 2,
        "sequence 0: nothing to train (every label is -100)"),
    "N20 data count of a pair that training refuses": Row(
        lambda s: ["data", "count", sft_pair(s, "oor", lambda t: np.where(np.arange(len(t)) == 13, 60000,
                                                                          trained_answers(t)))], 2,
        "label 13 = 60000 differs from its token"),
    "N20 data inspect of a pair that training refuses": Row(
        lambda s: ["data", "inspect", sft_pair(s, "none", lambda t: np.full(len(t), -100)), "-n", "1"], 0,
        "TRAINING REFUSES THIS DATASET"),
    "N23 --max-new-tokens beyond the context": Row(
        lambda s: ["generate", str(s.job()), "--prompt", "hi", "--max-new-tokens", "1000000000"], 2,
        "the model's context is 131072 tokens"),
    "N25 --temperature nan": Row(
        lambda s: ["generate", str(s.job()), "--prompt", "hi", "--temperature", "nan"], 2,
        "--temperature must be a finite number"),
    "N25 --top-p 2": Row(lambda s: ["generate", str(s.job()), "--prompt", "hi", "--top-p", "2"], 2,
                         "--top-p must be in (0, 1]"),
    "N25 --top-k -3": Row(lambda s: ["generate", str(s.job()), "--prompt", "hi", "--top-k", "-3"], 2,
                          "--top-k must be at least 1"),
    "N26 sampling an early checkpoint": Row(
        lambda s: ["generate", str(s.job("seed")), "--prompt", "hi", "--temperature", "3", "--max-new-tokens", "40"],
        0, "hi"),
    "N27 init_from a qwen3 job into a llama job": Row(
        lambda s: small(s, f"--checkpoint.init_from={s.job('qwen')}"), 2,
        "holds a qwen3 model, and this run's model is llama"),
    "N27 the same with load_mode model_partial": Row(
        lambda s: small(s, f"--checkpoint.init_from={s.job('qwen')}", "--checkpoint.load_mode=model_partial"), 0,
        "ignoring 4 checkpoint weight(s) (layers.0.attention.k_norm.weight"),
    "N27 a qwen3 checkpoint whose config says llama": Row(
        lambda s: ["convert", "to-hf", str(as_llama(s)), str(s.root / "hf")], 2,
        "holds weights this model has no place for (layers.0.attention.k_norm.weight"),
    "N31 an HF export of a built-in-template SFT job": Row(
        lambda s: ["convert", "to-hf", str(s.job("sft")), str(s.root / "hf")], 0, "",
        then=exported_with_chat_template),
    "N33 train on a checkpoint directory": Row(
        lambda s: ["train", str(s.job() / "checkpoints" / "latest"), "--training.steps=5"], 2,
        "is a checkpoint of the job"),
    "N33 status of a checkpoint directory": Row(
        lambda s: ["status", str(s.job() / "checkpoints" / "step-2")], 2, "is a checkpoint of the job"),
    "N35 cancel without SLURM's tools": Row(
        lambda s: ["cancel", str(slurm_record(s.job()))], 2, "squeue and scancel not on PATH",
        env={"PATH": "/nonexistent"}),
    "N39 a slurm_jobs.jsonl line that is a list": Row(
        lambda s: ["status", str(slurm_record(s.job(), "[1, 2]"))], 2,
        "slurm_jobs.jsonl:2: not a job record: expected an object"),
    "N39 a restart record without a job id": Row(
        lambda s: ["cancel", str(slurm_record(s.job(), '{"event": "restart"}'))], 2,
        "slurm_jobs.jsonl:2: not a job record: 'job_id'"),
    "N41 submit an indexed prefix": Row(
        lambda s: ["submit", DEMO, *tiny_overrides(s.base / "corpus.parquet", s.root / "jobs", "pfx"), "--no-submit",
                   source(s.base / "tok_text_document")], 0, "job directory", then=submitted_without_config_change),
    "N41 submit an llm.c glob": Row(
        lambda s: ["submit", DEMO, *tiny_overrides(s.base / "corpus.parquet", s.root / "jobs", "pfx"), "--no-submit",
                   source(s.base / "llmc" / "shard_*.bin")], 0, "job directory",
        then=submitted_without_config_change),
    "N42 one flipped bit, the default verify level": Row(
        lambda s: (flip_exponent_bit(s.job() / "checkpoints" / "step-3"),
                   ["train", str(s.root / "jobs" / "small"), "--training.steps=5"])[1], 0, "trained to step 5",
        then=resumed_past_the_damage),
    "N42 one flipped bit under verify = size": Row(
        lambda s: (flip_exponent_bit(s.job() / "checkpoints" / "step-3"),
                   ["train", str(s.root / "jobs" / "small"), "--training.steps=8", "--checkpoint.verify=size"])[1],
        2, "after loading the checkpoint", refusal=False, then=nothing_saved_after_the_damage),
    "N44 a manifest entry outside the checkpoint": Row(
        lambda s: (add_to_manifest(s.job() / "checkpoints" / "step-3", "../../../../../../etc/hostname",
                                   {"size": Path("/etc/hostname").stat().st_size, "crc32": "00000000"}),
                   ["checkpoint", "verify", str(s.root / "jobs" / "small" / "checkpoints" / "step-3")])[1], 1,
        "is not a file inside the checkpoint directory"),
    "N44 /dev/zero in a manifest, verify full": Row(
        lambda s: (add_to_manifest(s.job() / "checkpoints" / "step-3", "/dev/zero", {"size": 0, "crc32": "0"}),
                   ["checkpoint", "verify", str(s.root / "jobs" / "small" / "checkpoints" / "step-3"),
                    "--level", "full"])[1], 1, "'/dev/zero', which is not a file inside"),
    "N44 a FIFO named in a manifest, resume": Row(
        lambda s: (os.mkfifo(s.job() / "checkpoints" / "step-3" / "extra"),
                   add_to_manifest(s.root / "jobs" / "small" / "checkpoints" / "step-3", "extra",
                                   {"size": 0, "crc32": "00000000"}),
                   ["train", str(s.root / "jobs" / "small"), "--training.steps=4"])[2], 0, "trained to step 4"),
    "N45 a crafted .metadata reading another checkpoint": Row(
        lambda s: (craft_metadata(s.job() / "checkpoints" / "step-3", s.root / "jobs" / "small" / "checkpoints" /
                                  "step-1"), ["convert", "to-hf", str(s.root / "jobs" / "small" / "checkpoints" /
                                                                   "step-3"), str(s.root / "hf")])[1], 2,
        "which is not a file inside the checkpoint directory"),
    "N47 a symlinked step-N under retention": Row(symlinked_step, 0, "trained to step 4",
                                                    then=symlink_removed_archive_kept),
    "N50 a read-only job directory: train and report": Row(
        lambda s: ["train", str(s.job()), "--training.steps=4"], 2, "Read-only file system"),
    "N51 MAESTER_NO_JOB_LOCK=1": Row(
        lambda s: ["train", str(s.job()), "--training.steps=4"], 0, "is not locked",
        env={"MAESTER_NO_JOB_LOCK": "1"}),
    "N52 run.lock a directory": Row(lock_dir, 2, "run.lock is a directory, not the lock file"),
    "N52 a lock holder that is not an object": Row(
        lambda s: (s.hold(s.job(), b"[1, 2]"), ["train", str(s.root / "jobs" / "small"), "--training.steps=4"])[1],
        2, "in use by another run (holder unknown)"),
    "N54 seed-checkpoint of a running job": Row(
        lambda s: (s.hold(s.job("fresh")), ["seed-checkpoint", str(s.root / "jobs" / "fresh"),
                                            "--optimizer.lr=0.5"])[1], 2,
        "maester seed-checkpoint would rewrite the config of a running job"),
    "N54 seed-checkpoint of a job with a checkpoint": Row(
        lambda s: ["seed-checkpoint", str(s.job()), "--optimizer.lr=0.5"], 2, "already has a checkpoint (step-3)"),
    "N54 submit over a running job": Row(
        lambda s: (s.hold(s.job()), ["submit", DEMO, *tiny_overrides(s.base / "corpus.parquet", s.root / "jobs",
                                                                     "small"), "--no-submit", "--optimizer.lr=0.9"])[1],
        2, "maester submit would rewrite the config of a running job"),
    "N54 submit --chain 0": Row(
        lambda s: ["submit", DEMO, f"--job.dump_dir={s.root / 'jobs'}", "--name=ch0", "--no-submit", "--chain", "0"],
        2, "--chain 0: must be at least 1"),
    "N62 norm_eps -1": Row(lambda s: ["config", "show", DEMO, '--model.overrides={"norm_eps": -1}'], 2,
                           "model.overrides.norm_eps: Input should be greater than 0"),
    "N62 rope_theta 0": Row(lambda s: ["config", "show", DEMO, '--model.overrides={"rope_theta": 0}'], 2,
                            "model.overrides.rope_theta: Input should be greater than 0"),
    "N63 vocab_size 2^31": Row(lambda s: ["config", "show", DEMO, '--model.overrides={"vocab_size": 2147483648}'], 2,
                               "model.overrides.vocab_size: Input should be less than or equal to 2147483647"),
}


@pytest.fixture(scope="module")
def probe2(tmp_path_factory):
    """The jobs and data the rows copy: `small` (tiny Llama, 3 steps, a checkpoint at each), `seed` (its random
    weights as step-0), `qwen` (a tiny qwen3 seed), `sft` (a tiny SFT seed, chatml), `fresh` (a job directory
    without a checkpoint), a tokenized prefix, llm.c shards, and a `data download` of a mock Hub's dataset (whose
    server the rows that need it use)."""
    from maester.data.indexed import write_llmc_shard
    from maester.tools.data_tokenize import tokenize, tokenizer_config
    from tests.hub_server import MockHub
    from tests.test_hub import hub_env

    base = tmp_path_factory.mktemp("probe2")
    corpus = write_corpus(base / "corpus.parquet")
    code, _, err = run_in_process(["train", DEMO, *tiny_overrides(corpus, base / "jobs", "small", training__steps=3,
                                                                  checkpoint__interval=1, checkpoint__keep_last=3)])
    assert code == 0, err
    for command, name, extra in (("seed-checkpoint", "seed", {}), ("seed-checkpoint", "qwen", {"model__name": "qwen3"}),
                                 ("submit", "fresh", {})):
        code, _, err = run_in_process([command, DEMO, *tiny_overrides(corpus, base / "jobs", name, **extra)]
                                      + (["--no-submit"] if command == "submit" else []))
        assert code == 0, err
    from tests.data.test_sft import write_conversations

    write_conversations(base / "chats.jsonl", 8)
    seed_job(corpus, base / "jobs", "sft", data__mode="sft", data__seq_len=64,
             data__sources=json.dumps([{"path": str(base / "chats.jsonl")}]))
    tokenize([str(corpus)], str(base / "tok"), tokenizer_config("byte"))
    (base / "llmc").mkdir()
    for i in range(2):
        write_llmc_shard(base / "llmc" / f"shard_{i}.bin", np.arange(3000) % 250)
    hub = MockHub()
    docs = [f"document {i} about python and data" for i in range(40)]
    hub.add("org/ds", {f"data/train-{k}.parquet": parquet_of(docs[k::2]) for k in range(2)}, kind="datasets")
    env = hub_env(hub, base / "home")
    out = run_maester(["data", "download", "hf://datasets/org/ds/data", "--output", str(base / "dl")], base, env)
    assert out.returncode == 0, out.stderr
    yield base, env
    hub.stop()


def parquet_of(texts: list[str]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf)
    return buf.getvalue()


@contextlib.contextmanager
def captured_logs(stream=None):
    """The maester logger writes to `stream` (default: nowhere) while inside; the handlers a command adds (a job's
    logs/train.log) are closed after, so that later commands do not write into earlier jobs' logs."""
    logger = logging.getLogger("maester")
    saved, level = list(logger.handlers), logger.level
    logger.handlers = [logging.StreamHandler(stream or io.StringIO())]
    try:
        yield
    finally:
        for handler in logger.handlers:
            handler.close()
        logger.handlers = saved
        logger.setLevel(level)  # not the attribute: setLevel also clears the logger's cached checks


def run_in_process(args: list[str], timeout: int = 120, stdout: io.StringIO | None = None) -> tuple[int, str, str]:
    """`maester ARGS` in this process: (exit code, stdout, stderr with the log), stdout written into `stdout` if
    given. SIGALRM ends a command that hangs."""
    from maester.cli import main

    out, err = stdout or io.StringIO(), io.StringIO()

    def hung(signum, frame):
        raise TimeoutError(f"maester {' '.join(args)} still ran after {timeout} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(timeout)
    code = 0
    try:
        with captured_logs(err), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, object]:
    """Every path under `root` with its content's hash (a link: its target); left out: logs/*.log and the holder's
    name in run.lock, the record of an attempt."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.name == "run.lock":
            found[rel] = "lock"
        elif path.is_file() and not (path.parent.name == "logs" and path.suffix == ".log"):
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir() or stat.S_ISFIFO(path.lstat().st_mode):
            found[rel] = "dir" if path.is_dir() else "fifo"
    return found


def read_only_command(args: list[str], job: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`maester ARGS` in a mount namespace of its own where `job` is a read-only bind mount of itself."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "--map-root-user", "true"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("no mount namespaces here (unshare) for a read-only mount")
    q = shlex.quote(str(job))
    script = (f"mount --bind {q} {q} && mount -o remount,bind,ro {q} && exec {shlex.quote(sys.executable)} -m "
              f"maester {' '.join(shlex.quote(a) for a in args)}")
    return subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def assert_row(row: Row, scratch: Scratch, before: dict, code: int, output: str) -> None:
    """The row's exit code and text, no traceback; a refusal left the scratch directory (`before`) as it was."""
    assert code == row.code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert row.text in output, output[-3000:]
    if row.code not in (0, 1) and row.refusal:
        assert snapshot(scratch.root) == before, "a refusal changed files"
    if row.then is not None:
        row.then(scratch)


@pytest.mark.parametrize("case", PROBE_2)
def test_probe_2_case(probe2, tmp_path, monkeypatch, case):
    """The row's command gives its exit code and text, without a traceback; a refusal changes no file it was given
    (the scratch directory: jobs, checkpoints, data), and the rows that succeed leave what their check says."""
    base, hub_env = probe2
    row = PROBE_2[case]
    scratch = Scratch(tmp_path / "s", base)
    scratch.root.mkdir()
    monkeypatch.chdir(tmp_path)
    try:
        args = row.command(scratch)
        before = snapshot(scratch.root)
        if case.startswith("N50"):  # both commands, each in a mount namespace where the job is read-only
            for command in (args, ["report", args[1]]):
                done = read_only_command(command, Path(args[1]), tmp_path)
                assert done.returncode == row.code and row.text in done.stderr, (command, done.stderr[-3000:])
                assert "Traceback" not in done.stderr, done.stderr[-3000:]
            code, out, err = row.code, row.text, ""
        elif row.own_process:
            done = run_maester(args, tmp_path, {**hub_env, **row.env})
            code, out, err = done.returncode, done.stdout, done.stderr
        else:
            for name, value in row.env.items():
                monkeypatch.setenv(name, value)
            code, out, err = run_in_process(args)
        assert_row(row, scratch, before, code, out + err)
    finally:
        for holder in scratch.holders:
            holder.stdin.close()
            holder.wait(timeout=30)


# ------------------------------------------------------------------------------------------------------------------
# The probe of 24e698f, `maester plan`'s cases that fell short (R4, R9, R10), as rows of the same kind: the probe's
# command on a copy of the demo config in the row's scratch directory; a refusal leaves it as it was.

def demo_copy(s: Scratch) -> str:
    """The probe's $T/cfgs/demo.toml."""
    target = s.root / "cfgs" / "demo.toml"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEMO, target)
    return str(target)


PROBE_3_PLAN = {
    "R4 plan --gpu-memory nan": Row(lambda s: ["plan", demo_copy(s), "--gpus", "1", "--gpu-memory", "nan"], 2,
                                    "--gpu-memory nan must be a positive, finite number of GiB"),
    "R4 plan --gpu-memory inf": Row(lambda s: ["plan", demo_copy(s), "--gpus", "1", "--gpu-memory", "inf"], 2,
                                    "--gpu-memory inf must be a positive, finite number of GiB"),
    # The probe's 512 ranks of Llama 3 8B took 7 minutes without a line; the demo's 8 ranks show the same lines.
    "R9 plan --ranks all off a terminal": Row(
        lambda s: ["plan", demo_copy(s), "--gpus", "8", "--ranks", "all", "--training.micro_batch_size=2"], 0,
        "building every rank: 8 of 8 ranks in"),
    "R10 plan's time for a tiny model": Row(lambda s: ["plan", demo_copy(s), "--gpus", "1"], 0,
                                            "a small model (1.6M parameters in a token's matmuls)"),
}


@pytest.mark.parametrize("case", PROBE_3_PLAN)
def test_probe_3_plan_case(tmp_path, monkeypatch, case):
    """The row's command gives its exit code and text, without a traceback; a refusal changes no file."""
    row = PROBE_3_PLAN[case]
    scratch = Scratch(tmp_path / "s", tmp_path)
    scratch.root.mkdir()
    monkeypatch.chdir(tmp_path)
    args = row.command(scratch)
    before = snapshot(scratch.root)
    code, out, err = run_in_process(args)
    assert_row(row, scratch, before, code, out + err)



# The third probe (reliability-probe-3.md), its checkpoint verification rows: R39, a checkpoint written with a
# manifest whose manifest.json is gone; R40, a `.metadata` whose storage leaves the checkpoint.
def without_manifest(s: Scratch, written_before_manifests: bool = False, flip: bool = False) -> Path:
    """`small`'s step-3 without its manifest.json (`flip`: and with a flipped bit); `written_before_manifests`:
    its trainer state without the format that says a manifest was written, as checkpoints from before them."""
    step = s.job() / "checkpoints" / "step-3"
    (step / "manifest.json").unlink()
    if flip:
        flip_exponent_bit(step)
    if written_before_manifests:
        state = json.loads((step / "trainer_state.json").read_text())
        del state["checkpoint_format"]
        (step / "trainer_state.json").write_text(json.dumps(state))
    return step


def storage_outside(s: Scratch) -> Path:
    """N45's crafting: step-3's `.metadata` reads the embedding from step-1's file, its manifest made to match."""
    step = s.job() / "checkpoints" / "step-3"
    craft_metadata(step, s.root / "jobs" / "small" / "checkpoints" / "step-1")
    return step


def resumed_from_step_2(s: Scratch) -> None:
    """step-3 was set aside (kept), the run loaded step-2 and trained steps 3 and 4 on a live model."""
    steps = s.root / "jobs" / "small" / "checkpoints"
    assert (steps / "step-3.damaged").is_dir() and (steps / "step-4").is_dir()
    job = s.root / "jobs" / "small"
    assert [e["checkpoint"] for e in read_events(job) if e["event"] == "checkpoint_damaged"][-1:] == ["step-3"]
    trained = [e for e in read_metrics(job / "metrics.jsonl") if e["step"] >= 3]
    assert [e["step"] for e in trained][-2:] == [3, 4] and all(e["grad_norm"] > 0 for e in trained)


def verify(step: Path, *extra: str) -> list[str]:
    return ["checkpoint", "verify", str(step), *extra]


def train_small(s: Scratch) -> list[str]:
    return ["train", str(s.root / "jobs" / "small"), "--training.steps=4"]


PROBE_3_VERIFY = {
    "R39 verify: no manifest, written with one": Row(
        lambda s: verify(without_manifest(s)), 1,
        "manifest.json: missing, and trainer_state.json says the checkpoint was written with one"),
    "R39 verify: no manifest, from before manifests": Row(
        lambda s: verify(without_manifest(s, written_before_manifests=True)), 0,
        "unverified: no manifest (written before manifests existed)"),
    "R39 resume: no manifest and a flipped bit": Row(
        lambda s: (without_manifest(s, flip=True), train_small(s))[1], 0, "moved aside to step-3.damaged",
        then=resumed_from_step_2),
    "R40 verify --level full: storage outside the checkpoint": Row(
        lambda s: verify(storage_outside(s), "--level", "full"), 1,
        "which is not a file inside the checkpoint directory"),
    "R40 resume: storage outside the checkpoint": Row(
        lambda s: (storage_outside(s), train_small(s))[1], 0, "moved aside to step-3.damaged",
        then=resumed_from_step_2),
}


@pytest.mark.parametrize("case", PROBE_3_VERIFY)
def test_probe_3_verify_case(probe2, tmp_path, monkeypatch, case):
    """As `test_probe_2_case`: the row's exit code and text without a traceback; `verify` changes no file, whatever
    it finds."""
    row = PROBE_3_VERIFY[case]
    scratch = Scratch(tmp_path / "s", probe2[0])
    scratch.root.mkdir()
    monkeypatch.chdir(tmp_path)
    args = row.command(scratch)
    before = snapshot(scratch.root)
    code, out, err = run_in_process(args)
    assert code == row.code, (out + err)[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert row.text in out + err, (out + err)[-3000:]
    if args[0] == "checkpoint" or (row.code != 0 and row.refusal):
        assert snapshot(scratch.root) == before, "a refusal changed files"
    if row.then is not None:
        row.then(scratch)


# The probe of 24e698f: its cases that fell short at the seams added since (`eval`, `submit` onto a stopped job,
# `generate` of a long answer, `convert`'s upload and shard size, `report` of a damaged plan.json), each a row as in
# PROBE_2, on copies of PROBE_2's jobs. A refusal is one line (the last of stderr, naming what it refuses) with exit
# 2, and changes no file.

@dataclass
class Row3(Row):
    check: Callable[["Scratch", str, str], None] | None = None
    """A further check after the command, given the scratch and its (first run's) stdout and stderr."""
    unloaded: bool = False
    """The refusal comes before any model is loaded: the command names no checkpoint it read."""
    read_only: str | None = None
    """A directory of the scratch that the command sees mounted read-only (in a mount namespace of its own)."""
    stop_after: int | None = None
    """The command's stdout ends it, as Ctrl-C does, once it holds this many characters."""
    repeat: int = 1
    """Run the command this many times, each checked (a race that one run may win by chance)."""


class LiveJobs:
    """Tiny jobs that train on (for hours) in the background, with a checkpoint at every step and only the newest
    kept: running jobs for the rows to read, started on first use and shared by the rows of the module."""

    def __init__(self, root: Path, corpus: Path):
        self.root, self.corpus = root, corpus
        self.trainers: dict[str, subprocess.Popen] = {}

    def job(self, name: str = "live") -> Path:
        """The job `name`, training, once it has saved three checkpoints (its first steps are slower)."""
        import time

        job = self.root / "jobs" / name
        if name not in self.trainers:
            args = tiny_overrides(self.corpus, self.root / "jobs", name, training__steps=100000,
                                  checkpoint__interval=1, checkpoint__keep_last=1, logging__interval=1000)
            self.trainers[name] = subprocess.Popen(
                [sys.executable, "-m", "maester", "train", DEMO, *args], stdout=open(self.root / f"{name}.log", "w"),
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=clean_env(OMP_NUM_THREADS="1"),
                start_new_session=True)
        latest, deadline = job / "checkpoints" / "latest", time.monotonic() + 600
        while int(os.readlink(latest).split("-")[1] if latest.is_symlink() else 0) < 3:
            assert self.trainers[name].poll() is None, (self.root / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no third checkpoint after 600 s"
            time.sleep(0.2)
        return job

    def end(self) -> None:
        for proc in self.trainers.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def live_jobs(tmp_path_factory):
    jobs = LiveJobs(tmp_path_factory.mktemp("live"), write_corpus(tmp_path_factory.mktemp("live-data") / "c.parquet"))
    yield jobs
    jobs.end()


class LiveScratch(Scratch):
    """A scratch whose rows may read a job that is training (`live`)."""

    def __init__(self, root: Path, base: Path, live: LiveJobs):
        super().__init__(root, base)
        self.live = live

    def training(self) -> Path:
        return self.live.job()


def task_file(s: Scratch, name: str) -> str:
    """A copy of the shipped pydoc_choice task (its data beside it) with one error, as `<name>.yaml`."""
    from maester.evaluation.task_specs import SHIPPED_TASKS

    tasks = s.root / "tasks"
    tasks.mkdir(exist_ok=True)
    for data in ("data.py", "pydoc_choice.jsonl"):
        shutil.copy(SHIPPED_TASKS / data, tasks / data)
    text = (SHIPPED_TASKS / "pydoc_choice.yaml").read_text().replace("task: pydoc_choice", f"task: probe_{name}")
    edits = {"syntax": ('doc_to_text: "{{context}}"', "doc_to_text: {{context"),
             "badjinja": ("{{context}}", "{{context | nosuchfilter}}"),
             "badfield": ("{{context}}", "{{nosuchfield}}"),
             "badmetric": ("metric: acc\n    aggregation: mean", "metric: nosuchmetric"),
             "pyobj": ("test_split: test", f"test_split: !!python/object/apply:os.system ['touch {s.root}/PWNED']")}
    old, new = edits[name]
    assert old in text
    (tasks / f"{name}.yaml").write_text(text.replace(old, new))
    return str(tasks / f"{name}.yaml")


def evaluate(s: Scratch, *extra: str, job: Path | None = None, tasks: str = "pydoc_choice") -> list[str]:
    return ["eval", str(job or s.job()), "--tasks", tasks, "--limit", "4", *extra]


def truncated(s: Scratch) -> Path:
    """A copy of `small` whose newest checkpoint (step-3) has a shard cut short."""
    job = s.job()
    shard = max((job / "checkpoints" / "step-3").glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    return job


def evaluated(step: str, output: str):
    """The JSON of --output names the checkpoint and its step, and the console named it."""
    def check(s: Scratch, out: str, err: str) -> None:
        config = json.loads((s.root / output).read_text())["config"]
        assert config["checkpoint"].endswith(f"/checkpoints/{step}") and config["step"] == int(step.split("-")[1])
        assert f"evaluating {config['checkpoint']} (step {config['step']})" in err
    return check


def read_while_training(s: LiveScratch, out: str, err: str) -> None:
    """The checkpoint the first run read was the live job's, and the job goes on saving newer ones (within 300 s:
    on a loaded machine ten reads can end before its next step does)."""
    import re
    import time

    from maester.train.checkpoint_dirs import STEP_DIR, step_dirs

    def newest() -> int:
        saved = step_dirs(s.training() / "checkpoints")
        return int(STEP_DIR.match(saved[0].name)[1]) if saved else 0

    read = int(re.search(r"/checkpoints/step-(\d+) \(step \d+\)", err)[1])
    deadline = time.monotonic() + 300
    while (latest := newest()) <= read and time.monotonic() < deadline:
        time.sleep(0.2)
    assert latest > read, (read, latest)


def stopped_job(s: Scratch) -> Path:
    """A copy of `small` as SIGTERM leaves a job: requeue-requested, no COMPLETED marker."""
    from maester.train.preemption import COMPLETED_FILE, REQUEUE_FILE

    job = s.job()
    (job / COMPLETED_FILE).unlink()
    (job / REQUEUE_FILE).write_text(json.dumps({"step": 3, "reason": "SIGTERM"}) + "\n")
    return job


def resubmit(s: Scratch, *extra: str) -> list[str]:
    """`submit` of the config `small` was trained with, onto (a copy of) it, with `extra` overrides."""
    return ["submit", DEMO, *tiny_overrides(s.base / "corpus.parquet", s.root / "jobs", "small", training__steps=3,
                                            checkpoint__interval=1, checkpoint__keep_last=3), "--no-submit", *extra]


def config_says(key: str, value) -> Callable[[Scratch, str, str], None]:
    def check(s: Scratch, out: str, err: str) -> None:
        section, name = key.split(".")
        assert json.loads((s.root / "jobs" / "small" / "config.json").read_text())[section][name] == value
    return check


def export_kept(s: Scratch, out: str, err: str) -> None:
    assert (s.root / "hf" / "config.json").is_file() and list((s.root / "hf").glob("*.safetensors"))


def with_plan(s: Scratch, text: str) -> Path:
    job = s.job()
    (job / "plan.json").write_text(text)
    return job


def report_drawn(s: Scratch, out: str, err: str) -> None:
    assert (s.root / "jobs" / "small" / "report.png").stat().st_size > 0
    assert "planned memory" not in (s.root / "jobs" / "small" / "report.txt").read_text()


def streamed(s: Scratch, out: str, err: str) -> None:
    """Ended (as by Ctrl-C) once its output held 60 characters: the answer came out as it was generated."""
    assert out.startswith("hi") and len(out) >= 60, out


PROBE_3 = {
    "R13 a task YAML with a syntax error": Row3(
        lambda s: evaluate(s, tasks=task_file(s, "syntax")), 2, "syntax.yaml: cannot be read as YAML", unloaded=True),
    "R13 an unknown Jinja filter": Row3(
        lambda s: evaluate(s, tasks=task_file(s, "badjinja")), 2, "No filter named 'nosuchfilter'", unloaded=True),
    "R13 an undefined field": Row3(
        lambda s: evaluate(s, tasks=task_file(s, "badfield")), 2, "'nosuchfield' is undefined", unloaded=True),
    "R13 a metric without aggregation": Row3(
        lambda s: evaluate(s, tasks=task_file(s, "badmetric")), 2, "nosuchmetric", unloaded=True),
    "R13 a python tag": Row3(
        lambda s: evaluate(s, tasks=task_file(s, "pyobj")), 2, "pyobj.yaml: cannot be read as YAML", unloaded=True),
    "R14 eval of a job that is training, 3 times": Row3(
        lambda s: evaluate(s, job=s.training()), 0, "evaluating", check=read_while_training, repeat=3),
    "R14 generate from a job that is training, 10 times": Row3(
        lambda s: ["generate", str(s.training()), "--prompt", "hi", "--max-new-tokens", "4"], 0, "sampling from",
        check=read_while_training, repeat=10),
    "R17 --output a directory": Row3(
        lambda s: evaluate(s, "--output", str(s.root / "jobs")), 2, "is a directory", unloaded=True),
    "R17 --output on a read-only mount": Row3(
        lambda s: (s.root.joinpath("ro").mkdir(), evaluate(s, "--output", str(s.root / "ro" / "r.json")))[1], 2,
        "Read-only file system", unloaded=True, read_only="ro"),
    "R18 --limit nan": Row3(lambda s: evaluate(s, "--limit", "nan"), 2, "--limit", unloaded=True),
    "R18 --num-fewshot -1": Row3(lambda s: evaluate(s, "--num-fewshot", "-1"), 2, "--num-fewshot -1",
                                 unloaded=True),
    "R21 eval names the checkpoint it evaluated": Row3(
        lambda s: evaluate(s, "--output", str(s.root / "x.json"), job=truncated(s)), 0,
        "skipping the damaged checkpoint", check=evaluated("step-2", "x.json")),
    "R21 generate names the checkpoint it sampled": Row3(
        lambda s: ["generate", str(truncated(s)), "--prompt", "hi", "--max-new-tokens", "4"], 0,
        "/checkpoints/step-2 (step 2)"),
    "R22 a broken task file in evaluation.tasks": Row3(
        lambda s: small(s, f'--evaluation.tasks=["{task_file(s, "syntax")}"]', "--evaluation.interval=1"), 2,
        "syntax.yaml: cannot be read as YAML"),
    "R23 a Hub task offline, eval": Row3(
        lambda s: evaluate(s, tasks="hellaswag"), 2, "--download-only --tasks hellaswag",
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, own_process=True, unloaded=True),
    "R23 --include-path a missing directory": Row3(
        lambda s: evaluate(s, "--include-path", str(s.root / "nonexistdir")), 2, "nonexistdir does not exist",
        unloaded=True),
    "R48 submit onto a finished job with another lr": Row3(
        lambda s: (s.job(), resubmit(s, "--optimizer.lr=0.9"))[1], 2, "optimizer.lr=0.9"),
    "R48 submit onto a stopped job with fewer steps": Row3(
        lambda s: (stopped_job(s), resubmit(s, "--training.steps=2"))[1], 2, "training.steps=2"),
    "R48 submit onto a job with another model, --update-config": Row3(
        lambda s: (s.job(), resubmit(s, "--model.flavor=demo", "--update-config"))[1], 2, "model.flavor='demo'"),
    "R48 submit --update-config": Row3(
        lambda s: (s.job(), resubmit(s, "--optimizer.lr=0.9", "--update-config"))[1], 0, "optimizer.lr=0.9",
        check=config_says("optimizer.lr", 0.9)),
    "R48 submit the job's own config again": Row3(
        lambda s: (stopped_job(s), resubmit(s))[1], 0, "job directory", check=config_says("optimizer.lr", 3e-3)),
    "R49 convert --upload without a network": Row3(
        lambda s: ["convert", "to-hf", str(s.job()), str(s.root / "hf"), "--upload", "org/name"], 2,
        "upload it again with `hf upload org/name", env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_x"},
        own_process=True, refusal=False, check=export_kept),
    "R50 --max-shard-size 0": Row3(
        lambda s: ["convert", "to-hf", str(s.job()), str(s.root / "hf"), "--max-shard-size", "0"], 2,
        "--max-shard-size '0'"),
    "R50 --max-shard-size abc": Row3(
        lambda s: ["convert", "to-hf", str(s.job()), str(s.root / "hf"), "--max-shard-size", "abc"], 2,
        "--max-shard-size 'abc'"),
    "R52 generate streams a long answer": Row3(
        lambda s: ["generate", str(s.job()), "--prompt", "hi", "--max-new-tokens", "131000"], 130, "interrupted",
        refusal=False, stop_after=60, check=streamed),
    "R53 report of a job whose plan.json is not JSON": Row3(
        lambda s: ["report", str(with_plan(s, "{garbage"))], 0, "plan.json", check=report_drawn),
    "R53 report of a plan.json with a bad number": Row3(
        lambda s: ["report", str(with_plan(s, json.dumps({"peak_gib": "lots", "gpus": 8, "gpu": "H100"})))], 0,
        "plan.json", check=report_drawn),
}


class Ending(io.StringIO):
    """stdout that ends the command, as Ctrl-C does, once it holds `limit` characters."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def write(self, text: str) -> int:
        n = super().write(text)
        if len(self.getvalue()) >= self.limit:
            raise KeyboardInterrupt
        return n


def run_row3(row: Row3, args: list[str], scratch: Scratch, tmp_path: Path, hub_env: dict, monkeypatch):
    """(exit code, stdout, stderr) of the row's command: in this process, or in its own (a Hub endpoint or an
    offline switch read at import, a read-only mount)."""
    if row.read_only is not None:
        done = read_only_command(args, scratch.root / row.read_only, tmp_path)
        return done.returncode, done.stdout, done.stderr
    if row.own_process:
        done = run_maester(args, tmp_path, {**hub_env, **row.env})
        return done.returncode, done.stdout, done.stderr
    for name, value in row.env.items():
        monkeypatch.setenv(name, value)
    return run_in_process(args, stdout=None if row.stop_after is None else Ending(row.stop_after))


@pytest.mark.parametrize("case", PROBE_3)
def test_probe_3_case(probe2, live_jobs, tmp_path, monkeypatch, case):
    """The row's command gives its exit code and text, without a traceback; a refusal is one line, the last of
    stderr, and changes no file it was given; a row that reads no model says nothing of a checkpoint."""
    base, hub_env = probe2
    row = PROBE_3[case]
    scratch = LiveScratch(tmp_path / "s", base, live_jobs)
    scratch.root.mkdir()
    monkeypatch.chdir(tmp_path)
    args = row.command(scratch)
    before = snapshot(scratch.root)
    runs = [run_row3(row, args, scratch, tmp_path, hub_env, monkeypatch) for _ in range(row.repeat)]
    for code, out, err in runs:
        assert code == row.code, (out + err)[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert row.text in out + err, (out + err)[-3000:]
        if row.code == 2 and row.refusal:
            assert row.text in err.strip().splitlines()[-1], err[-3000:]
        if row.unloaded:
            assert "/checkpoints/step-" not in out + err, (out + err)[-3000:]
    if row.code == 2 and row.refusal:
        assert snapshot(scratch.root) == before, "a refusal changed files"
    if row.check is not None:
        row.check(scratch, *runs[0][1:])
