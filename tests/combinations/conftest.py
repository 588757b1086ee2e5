"""What the combination matrix shares within a pytest process: the data of each kind, a seed checkpoint and its Hugging
Face export per model family, and two zygotes (`processes.Zygote`): one with torchao imported, for training, and one
without, for exports (the worker's own, `tests.forks`, where it has one). `pytest -m combinations` runs the full
matrix; without it those tests are skipped. At the end the run prints the pairs covered, the cells run and the
seconds they took."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.combinations.cells import FAMILY, Files
from tests import forks
from tests.processes import REPO, Zygote
from tests.helpers import clean_env, write_corpus

TRAIN_PRELOAD = ["torch", "maester.cli", "maester.train.trainer", "maester.parallel.parallelize",
                 "maester.parallel.float8", "torchao.float8", "torch.distributed.checkpoint",
                 "torch.distributed.pipelining", "torch._dynamo", "torch._inductor.compile_fx",
                 "tests.combinations.warm_compile"]  # last: Dynamo's and Inductor's set-up done once, not per rank
EXPORT_PRELOAD = ["torch", "maester.cli", "maester.tools.convert", "maester.tools.generate",
                  "maester.train.checkpoint"]  # no torchao: see export.py
SFT_SEQ = 64  # conversations need more room than the 32 tokens of the other cells
MARKERS = {"<<<|user|>>>": "<|user|>", "<<<|assistant|>>>": "<|assistant|>"}


def pytest_collection_modifyitems(config, items):
    if "combinations" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="the full combination matrix runs with `pytest -m combinations`")
    for item in items:
        if item.get_closest_marker("combinations") is not None:
            item.add_marker(skip)


def _data(root) -> dict[str, dict[str, str]]:
    from maester.cli import main
    from tests.data.test_sft import write_conversations
    from tests.data.test_sft_indexed import write_marker_jsonl

    corpus = write_corpus(root / "corpus.parquet")
    main(["data", "tokenize", str(corpus), "--output-prefix", str(root / "corpus"), "--tokenizer", "byte"])
    chats = root / "chats.jsonl"
    write_conversations(chats, 80)
    marked = root / "marked.jsonl"
    write_marker_jsonl(marked, 80)
    main(["data", "tokenize", str(marked), "--output-prefix", str(root / "marked"), "--tokenizer", "byte",
          "--control-tokens", *[f"{m}={t}" for m, t in MARKERS.items()], "--template", "markers"])
    source = lambda path: json.dumps([{"path": str(path)}])  # noqa: E731
    return {
        "text": {"data.sources": source(corpus)},
        "indexed": {"data.sources": source(root / "corpus_text_document")},
        "sft": {"data.mode": "sft", "data.sources": source(chats), "data.document_masking": "true",
                "data.seq_len": SFT_SEQ},
        "labels": {"data.mode": "sft", "data.sources": source(root / "marked_text_document"),
                   "data.sft.template": "markers", "tokenizer.control_tokens": json.dumps(MARKERS),
                   "data.seq_len": SFT_SEQ},
    }


def _seeds(files: Files) -> None:
    """Per family a seed checkpoint (model_only starts from it) and its export (hf starts from that)."""
    from maester.cli import main
    from maester.config import load_config
    from maester.train.trainer import write_seed_checkpoint

    for family, settings in FAMILY.items():
        overrides = [f"--{k}={v}" for k, v in {**settings, "model.flavor": "tiny", "job.name": f"seed-{family}",
                                               "job.dump_dir": str(files.root / "seeds")}.items()]
        cfg = load_config(files.root / "base.toml", overrides, environ={})
        files.seeds[family] = write_seed_checkpoint(cfg, cfg.job_dir)
        files.hf[family] = files.root / "seeds" / f"hf-{family}"
        main(["convert", "to-hf", str(files.seeds[family]), str(files.hf[family])])


@pytest.fixture(scope="session")
def matrix_files(tmp_path_factory) -> Files:
    root = tmp_path_factory.mktemp("matrix")
    (root / "base.toml").write_text('[job]\nname = "cell"\n')
    (root / "logs").mkdir()
    files = Files(root, _data(root))
    _seeds(files)
    return files


def _zygote(root, name: str, preload: list[str]) -> Zygote:
    env = clean_env(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", XDG_CACHE_HOME=str(root / "cache"),
                    PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    return Zygote(preload, env, root / "logs" / f"zygote-{name}.log")


@pytest.fixture(scope="session")
def zygotes(matrix_files):
    """(training zygote, export zygote): the exports fork from the worker's own zygote (`tests.forks`: torch and
    maester, no torchao) where it has one, rather than from a third process importing the same."""
    started = time.monotonic()
    train = _zygote(matrix_files.root, "train", TRAIN_PRELOAD)
    shared = forks.zygote_for(clean_env())
    export = shared or _zygote(matrix_files.root, "export", EXPORT_PRELOAD)
    print(f"zygotes ready in {time.monotonic() - started:.1f} s")
    yield train, export
    train.close()
    if shared is None:
        export.close()
