"""The reliability probe of bdbdced, kept as a table so that what holds stays held: each case is the probe's
command (its id in the name) with the exit code and the text a user must see. The cases that failed then have
their own tests, listed in `FIXED_ELSEWHERE`; the README's reliability section counts both."""

from __future__ import annotations

import json

import numpy as np
import pytest

from maester.data.indexed import IndexedDatasetWriter
from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, write_corpus

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
