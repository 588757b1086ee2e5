"""`checkpoint.init_from = "hf:PATH"`: a run starts from a Hugging Face directory's weights, in one process and
under FSDP, and its first loss is the loss `transformers` computes on the same batch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from maester.config import ConfigError, load_config
from maester.data.batch import IGNORE_INDEX
from maester.jobs.job_dir import write_job_dir
from maester.models.hf_tensors import read_hf_tensors, state_dict_from_hf
from maester.tools.convert import from_hf
from maester.train.checkpoint import resolve_checkpoint
from maester.train.checkpoint_files import read_trainer_state
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides, torchrun, write_corpus
from tests.models.test_hf_parity import random_hf_model, tiny_args

transformers = pytest.importorskip("transformers")

CASE = "gemma3"  # tied embeddings, sandwich norms, sliding windows: a mistake in any of them changes the loss
RUN = dict(training__steps=1, schedule__warmup_steps=0, checkpoint__interval=0, optimizer__lr=1e-3)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random transformers model saved as an HF directory, a corpus, and the overrides of a run of its
    architecture (`model.hf_config`) that starts from its weights."""
    root = tmp_path_factory.mktemp("init_from_hf")
    name, args = tiny_args(CASE)
    hf = random_hf_model(name, args, seed=5)
    hf.save_pretrained(root / "hf")
    corpus = write_corpus(root / "data" / "corpus.parquet")
    overrides = dict(RUN, model__flavor="demo", model__hf_config=str(root / "hf"),
                     checkpoint__init_from=f"hf:{root / 'hf'}")
    return root, hf, corpus, overrides


def hf_loss(hf, batches) -> float:
    """transformers' loss of one step: the token losses of all micro-batches over their label tokens."""
    total, labels = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = hf(b.input_ids).logits
            total += F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="sum").item()
            labels += int((b.labels != IGNORE_INDEX).sum())
    return total / labels


def test_one_process_run_starts_from_the_hf_weights(source):
    root, hf, corpus, overrides = source
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "one", **overrides), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    name, args = tiny_args(CASE)
    expected = state_dict_from_hf(name, args, read_hf_tensors(root / "hf"))
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in expected.items())
    state = trainer.loader.state_dict()
    first = trainer.loader.next_step()
    trainer.loader.load_state_dict(state)
    result = trainer.train()
    assert read_metrics(cfg.job_dir / "metrics.jsonl")[0]["loss"] == pytest.approx(hf_loss(hf, first), rel=1e-5)
    assert {k: read_trainer_state(result.checkpoint)[k] for k in ("init_from", "load_mode")} == {
        "init_from": f"hf:{root / 'hf'}", "load_mode": "model_only"}

    # the same weights through a checkpoint that `maester convert from-hf` wrote
    from_hf(root / "hf", root / "converted", tokenizer=False)
    via = dict(overrides, checkpoint__init_from=str(root / "converted"))
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "via", **via), environ={})
    assert all(torch.equal(Trainer(cfg, cfg.job_dir).model.state_dict()[k], v) for k, v in expected.items())


def test_fsdp_run_starts_from_the_hf_weights(source, tmp_path):
    """Here from a Hub id (the mock Hub on 127.0.0.1), whose weights take longer to download than the collective
    timeout (N5): they are fetched before the process group exists, by local rank 0 while rank 1 waits on the
    cache's lock, so no rank waits in a collective meanwhile. Fetched by rank 0 inside the load, after
    init_process_group, the download ended rank 1's wait in a gloo timeout."""
    from tests.hub_server import MockHub
    from tests.test_hub import hub_env

    root, hf, corpus, overrides = source
    hub = MockHub()
    try:
        hub.add("org/tiny-gemma3", {f.name: f.read_bytes() for f in (root / "hf").iterdir()})
        # the collective timeout: above the ranks' skew in setup on a loaded machine, below the download
        hub.delays[".safetensors"] = 15.0
        hub_overrides = dict(overrides, checkpoint__init_from="hf:org/tiny-gemma3", training__init_timeout_seconds=10)
        cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "fsdp", **hub_overrides), environ={})
        write_job_dir(cfg)
        run = torchrun(2, ["train", str(cfg.job_dir)], root,  # the Hub client waits longer than the delay
                       env=hub_env(hub, tmp_path / "hf-home", HF_HUB_DOWNLOAD_TIMEOUT="60"))
    finally:
        hub.stop()
    assert run.returncode == 0, run.stderr[-4000:]
    assert "dp_shard 2" in run.stderr
    assert [name for name, _ in hub.reads if name.endswith(".safetensors")] == ["model.safetensors"]
    one = load_config(None, tiny_overrides(corpus, root / "jobs", "peek", **{**overrides,
                                                                             "checkpoint__init_from": "null"}),
                      environ={})
    first = Trainer(one, one.job_dir).loader.next_step()  # the global batch is the same on any number of ranks
    assert read_metrics(cfg.job_dir / "metrics.jsonl")[0]["loss"] == pytest.approx(hf_loss(hf, first), rel=1e-5)
    state = json.loads((resolve_checkpoint(cfg.job_dir) / "trainer_state.json").read_text())
    assert state["init_from"] == "hf:org/tiny-gemma3"


def test_a_model_that_is_not_the_hf_one_is_refused(source):
    root, _, corpus, overrides = source
    hf_dir = root / "hf"
    other = dict(RUN, checkpoint__init_from=f"hf:{hf_dir}")  # the tiny llama, not the HF gemma3
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "llama", **other), environ={})
    with pytest.raises(ValueError, match=r"architecture \(run llama, HF gemma3\).*model.hf_config = \"" +
                       str(hf_dir)):
        Trainer(cfg, cfg.job_dir)
    # the same architecture with one field changed: that field is named, and only it
    fewer = dict(other, model__name="gemma3", model__overrides='{"n_layers": 4}')
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "fewer", **fewer), environ={})
    with pytest.raises(ValueError, match=r"differs from .*config.json in n_layers \(run 4, HF 6\): set"):
        Trainer(cfg, cfg.job_dir)


@pytest.mark.parametrize("mode", ["model_data", "continue", "transfer"])
def test_load_modes_that_take_more_than_weights_are_refused(mode):
    with pytest.raises(ConfigError, match=f"load_mode = '{mode}' takes the .* is a Hugging Face directory, which "
                                          "holds only weights: use load_mode = 'model_only'"):
        load_config(None, ["--checkpoint.init_from=hf:some/dir", f"--checkpoint.load_mode={mode}"], environ={})
    with pytest.raises(ConfigError, match="give the Hugging Face model directory"):
        load_config(None, ["--checkpoint.init_from=hf:"], environ={})


RANK_SCRIPT = """
import datetime, sys, torch, torch.distributed as dist
from pathlib import Path
from maester.config import load_config
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides

root, corpus, overrides = Path(sys.argv[1]), Path(sys.argv[2]), dict(a.split("=", 1) for a in sys.argv[3:])
rank = int(__import__("os").environ["RANK"])
opened = []
if rank != 0:
    weights = (str(root / "hf") + "/", str(root / "trap") + "/")
    sys.addaudithook(lambda event, args: opened.append(str(args[0]))
                     if event == "open" and str(args[0]).startswith(weights) else None)
    overrides["checkpoint__init_from"] = f"hf:{root / 'trap'}"  # unreadable weights: reading them fails
cfg = load_config(None, tiny_overrides(corpus, root / "jobs", f"bcast{rank}", **overrides), environ={})
try:
    trainer = Trainer(cfg, cfg.job_dir)
except Exception as e:
    sys.stderr.write(f"rank {rank} raised {type(e).__name__}: {e}\\n")  # one write: ranks may share stderr
    sys.stderr.flush()
    if dist.is_initialized():  # each rank's line is written before either ends (a launcher ends the others then)
        try:
            if dist.get_backend() == "gloo":  # a barrier that gives up on a rank that never comes
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            else:
                dist.barrier()
        except RuntimeError as barrier:
            sys.stderr.write(f"rank {rank}: {barrier}\\n")
    sys.exit(3)
full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
        for k, v in trainer.model.state_dict().items()}
torch.save({"state": full, "opened": opened}, root / f"rank{rank}.pt")
dist.destroy_process_group()
"""


def run_ranks(root, corpus, overrides, tmp_path):
    """RANK_SCRIPT on two processes, as torchrun starts them (`helpers.torchrun`)."""
    from tests.helpers import REPO, clean_env, torchrun

    script = tmp_path / "rank.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + RANK_SCRIPT)
    return torchrun(2, [str(root), str(corpus), *[f"{k}={v}" for k, v in overrides.items()]], tmp_path,
                    env=clean_env(OMP_NUM_THREADS="1"), timeout=300, script=script)


def check_ranks_other_than_0_never_open_the_weight_files(source, tmp_path, **extra):
    """Rank 1 is pointed at a directory whose weights cannot be read; it gets rank 0's weights by broadcast."""
    import shutil

    root, hf, corpus, overrides = source
    trap = root / "trap"
    trap.mkdir(exist_ok=True)
    shutil.copy(root / "hf" / "config.json", trap / "config.json")
    (trap / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(Exception):
        read_hf_tensors(trap)  # the trap is real: any rank that reads it fails
    for rank in (0, 1):
        (root / f"rank{rank}.pt").unlink(missing_ok=True)
    run = run_ranks(root, corpus, dict(overrides, **extra), tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    name, args = tiny_args(CASE)
    expected = state_dict_from_hf(name, args, read_hf_tensors(root / "hf"))
    for rank in (0, 1):
        got = torch.load(root / f"rank{rank}.pt")
        assert set(got["state"]) >= set(expected)
        assert all(torch.equal(got["state"][k], v) for k, v in expected.items()), rank
    # rank 1 reads the run's architecture (model.hf_config) but nothing of the directory it was told to load
    opened = torch.load(root / "rank1.pt")["opened"]
    assert str(root / "hf" / "config.json") in opened
    assert [p for p in opened if p.startswith(str(trap)) or "safetensors" in p] == []


def test_fsdp_ranks_other_than_0_never_open_the_weight_files(source, tmp_path):
    check_ranks_other_than_0_never_open_the_weight_files(source, tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one NCCL rank each)")
def test_fsdp_ranks_other_than_0_never_open_the_weight_files_on_nccl(source, tmp_path):
    check_ranks_other_than_0_never_open_the_weight_files(source, tmp_path, training__device="cuda",
                                                         training__precision="fp32")


def test_an_error_on_rank_0_is_raised_on_every_rank(source, tmp_path):
    root, hf, corpus, overrides = source
    bad = dict(overrides, checkpoint__init_from=f"hf:{root / 'missing'}", model__hf_config=str(root / "hf"))
    run = run_ranks(root, corpus, bad, tmp_path)
    assert run.returncode != 0
    assert "rank 0 raised HFFormatError" in run.stderr, run.stderr[-4000:]
    # a refusal (a ValueError) is the same refusal on every rank: the CLI exits 2 with its one line on each
    message = run.stderr.split("rank 0 raised HFFormatError: ", 1)[1].splitlines()[0]
    assert f"rank 1 raised ValueError: {message}" in run.stderr, run.stderr[-4000:]
