"""One error format: every error a user can cause prints as one line, `maester <cmd>: error: ...`, exit 2, naming
the key, file or line; never a traceback. A table of such inputs (most from the reliability probe of bdbdced,
its case ids in the names), each run as a user would run it."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, write_corpus


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A scratch directory with a corpus and a trained tiny job (checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("errors")
    corpus = write_corpus(root / "corpus.parquet")
    out = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, root / "jobs", "job", training__steps=2,
                                                                    checkpoint__interval=2)], cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    (root / "badutf.toml").write_bytes(b"\xff\xfe[job]\n")
    (root / "badutf.jsonl").write_bytes(b'{"text": "a fine document"}\n{"text": "\xff\xfe"}\n')
    (root / "ok.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (root / "notext.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    corrupt_parquet(root / "midcorrupt.parquet")
    return root


def corrupt_parquet(path) -> None:
    """A Parquet file whose fourth row group's data is garbage (a bad disk block): readable up to there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"document number {i} " * 30 for i in range(4000)]}), path,
                   row_group_size=500, compression="snappy")
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(3).column(0).data_page_offset + 200
    data[start:start + 4800] = bytes((b * 7 + 13) % 256 for b in data[start:start + 4800])
    path.write_bytes(bytes(data))


def job_copy(root, tmp_path, damage=None):
    job = tmp_path / "job"
    shutil.copytree(root / "jobs" / "job", job, symlinks=True)
    if damage:
        damage(job / "checkpoints" / "step-2")
    return job


def train(root, *extra):
    return ["train", str(DEMO_CONFIG), *tiny_overrides(root / "corpus.parquet", root / "jobs", "new"), *extra]


# name -> (command given the scratch root and a fresh tmp_path, text the error line must hold)
CASES = {
    "C4 config not UTF-8": (lambda r, t: ["config", "show", str(r / "badutf.toml")],
                            "badutf.toml: not UTF-8 text"),
    "C6 wrong type": (lambda r, t: ["config", "show", str(DEMO_CONFIG), "--training.steps=abc"],
                      "training.steps: Input should be a valid integer"),
    "C8 lr = inf": (lambda r, t: ["config", "show", str(DEMO_CONFIG), "--optimizer.lr=inf"],
                    "optimizer.lr: Input should be a finite number"),
    "C9 seq_len beyond the model's context": (lambda r, t: train(r, "--data.seq_len=1000000000"),
                                              "data.seq_len = 1000000000 exceeds the model's context"),
    "C14 missing config": (lambda r, t: ["train", str(t / "nonexist.toml")], "nonexist.toml does not exist"),
    "C16 unknown flavor": (lambda r, t: ["config", "show", str(DEMO_CONFIG), "--model.flavor=huge"], "huge"),
    "C17 cuda without a GPU": (lambda r, t: train(r, "--training.device=cuda"),
                               "training.device = 'cuda', but"),
    "D1 no documents": (lambda r, t: train(r, f'--data.sources=[{{"path":"{t / "empty.jsonl"}"}}]'),
                        "empty.jsonl"),
    "D4 invalid UTF-8 in a loader worker": (
        lambda r, t: train(r, f'--data.sources=[{{"path":"{r / "badutf.jsonl"}"}}]', "--data.num_workers=1"),
        "badutf.jsonl:2: not valid UTF-8"),
    "D7 Parquet corrupt in the middle, in a loader worker": (
        lambda r, t: train(r, f'--data.sources=[{{"path":"{r / "midcorrupt.parquet"}"}}]', "--data.num_workers=1",
                           "--training.steps=60", "--data.seq_len=64"),
        "midcorrupt.parquet: row group 3 cannot be read"),
    "μP zero readout with a tied head": (
        lambda r, t: train(r, "--mup.enabled=true", "--mup.base_width=32", "--mup.zero_init_readout=true",
                           "--model.overrides.tie_embeddings=true"), "mup.zero_init_readout needs an untied"),
    "K7 trainer_state.json not an object": (
        lambda r, t: ["train", str(job_copy(r, t, lambda s: (s / "trainer_state.json").write_text("[1, 2]"))),
                      "--training.steps=4", "--checkpoint.verify=size"], "no intact checkpoint"),
    "K14 another model on resume": (
        lambda r, t: ["train", str(job_copy(r, t)), "--training.steps=4", "--model.flavor=demo"],
        "does not fit this run's model"),
    "K15 config.json garbage": (
        lambda r, t: ["train", str(job_copy(r, t, lambda s: (s.parent.parent / "config.json").write_text("{x")))],
        "config.json"),
    "X3 data count --output a directory": (
        lambda r, t: ["data", "count", str(r / "ok.jsonl"), "--tokenizer", "byte", "--output", str(t)],
        "is a directory"),
    "X4 metrics line without a step": (
        lambda r, t: ["report", str(job_copy(r, t, lambda s: open(s.parent.parent / "metrics.jsonl", "a").write(
            '{"loss": 1.0}\n')))], "metrics.jsonl:3: not a metrics record"),
    "X6 prompts file a directory": (
        lambda r, t: ["generate", str(r / "jobs" / "job"), "--prompts-file", str(t)], "is a directory, not a file"),
    "data: a record without the text field": (
        lambda r, t: ["data", "tokenize", str(r / "notext.jsonl"), "--output-prefix", str(t / "o"), "--tokenizer",
                      "byte"], "notext.jsonl:1: record has no field 'text'"),
    "checkpoint verify: nothing there": (lambda r, t: ["checkpoint", "verify", str(t)], "no checkpoint at"),
}


@pytest.mark.parametrize("case", CASES)
def test_user_errors_are_one_line(root, tmp_path, case):
    command, expected = CASES[case]
    if case.startswith("D1"):
        (tmp_path / "empty.jsonl").write_text("")
    args = command(root, tmp_path)
    out = run_maester(args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "pydantic.dev" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith(f"maester {args[0]}: error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert expected in out.stderr, out.stderr[-3000:]
