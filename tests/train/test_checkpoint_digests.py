"""The manifest's checksums: XXH3-128 of every file, taken while the bytes are written and equal to a hash of the
file read back; a flipped bit and a truncated file fail the full check, for the new checksum and for the CRC-32s of
manifests written before it; the directory entries are on disk before the manifest names them (G10); the writer
thread leaves the process's warning filters alone (G12)."""

from __future__ import annotations

import json
import shutil
import threading
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import xxhash

from maester.config import CheckpointConfig, ModelConfig, OptimizerConfig
from maester.models.build import build_model
from maester.train import checkpoint as checkpoint_module
from maester.train.checkpoint import Checkpointer
from maester.train.checkpoint_async import SaveResult
from maester.train.checkpoint_files import MANIFEST, TRAINER_STATE, verify_checkpoint
from maester.train.optim import build_optimizer


def tiny():
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavor="tiny"), 269, torch.device("cpu"), 0)
    optimizer = build_optimizer(model, OptimizerConfig(), torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    model, optimizer = tiny()
    return Checkpointer(tmp_path_factory.mktemp("digests"), CheckpointConfig()).save(
        1, model, optimizer, {"tokens_seen": 1}, "{}")


def copy_of(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / saved.name))


def flip_a_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def cut_short(file: Path) -> None:
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 1)


def as_crc32_manifest(path: Path) -> None:
    """The manifest as maester wrote it before format 2: no format, a CRC-32 per file."""
    files = {name: {"size": (path / name).stat().st_size, "crc32": f"{zlib.crc32((path / name).read_bytes()):08x}"}
             for name in json.loads((path / MANIFEST).read_text())["files"]}
    (path / MANIFEST).write_text(json.dumps({"step": 1, "files": files}))


def test_the_manifest_holds_the_xxh3_of_every_file_as_written(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["format"] == 2 and manifest["digest"] == "xxh3_128"
    on_disk = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        data = (saved / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}, name
    assert json.loads((saved / TRAINER_STATE).read_text())["checkpoint_format"] == 2
    assert verify_checkpoint(saved, "full") == []


@pytest.mark.parametrize("kind", ["xxh3_128", "crc32"])
@pytest.mark.parametrize("damage", [flip_a_bit, cut_short], ids=["flipped bit", "truncated"])
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "rng/rank0.pt"])
def test_a_damaged_file_fails_the_full_check(saved, tmp_path, kind, damage, name):
    path = copy_of(saved, tmp_path)
    if kind == "crc32":
        as_crc32_manifest(path)
    assert verify_checkpoint(path, "full") == []  # an old manifest still verifies
    damage(path / name)
    (problem,) = verify_checkpoint(path, "full")
    if damage is flip_a_bit:
        assert problem.startswith(f"{path / name}: {'XXH3-128' if kind == 'xxh3_128' else 'CRC-32'} ")
        assert verify_checkpoint(path, "size") == []  # the size is the same
    else:
        size = (path / name).stat().st_size
        assert problem == f"{path / name}: {size} bytes, the manifest says {size + 1}"


def test_directory_entries_are_flushed_before_the_manifest_names_them(tmp_path, monkeypatch):
    """G10: `step-N.tmp/` and its `rng/` are fsynced before manifest.json is written into them."""
    events = []
    real_fsync_dir, real_write = checkpoint_module.fsync_dir, checkpoint_module.write_durably
    monkeypatch.setattr(checkpoint_module, "fsync_dir", lambda p: (events.append(("fsync_dir", Path(p).name)),
                                                                   real_fsync_dir(p)))
    monkeypatch.setattr(checkpoint_module, "write_durably", lambda p, d: (events.append(("write", Path(p).name)),
                                                                          real_write(p, d)))
    model, optimizer = tiny()
    Checkpointer(tmp_path, CheckpointConfig()).save(2, model, optimizer, {}, "{}")
    manifest_at = events.index(("write", MANIFEST))
    assert ("fsync_dir", "rng") in events[:manifest_at] and ("fsync_dir", "step-2.tmp") in events[:manifest_at]


def test_the_writer_thread_leaves_the_warning_filters_alone(tmp_path):
    """G12: a filter the training thread sets while a background write is in DCP's save is still set after it."""
    inside, go_on = threading.Event(), threading.Event()

    class Slow:  # a value DCP pickles in the writer thread: it waits there until the filter is set
        def __reduce__(self):
            inside.set()
            go_on.wait(60)
            return (int, (0,))

    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    state = {"model": {"w": torch.zeros(4)}, "extra": Slow()}
    result = SaveResult(3, checkpointer.dir / "step-3", True)
    thread = threading.Thread(target=checkpointer._write, args=(3, state, {}, result))
    thread.start()
    assert inside.wait(60)
    warnings.filterwarnings("ignore", message="a filter set while a checkpoint is written")
    go_on.set()
    thread.join(60)
    try:
        assert any(f[1] is not None and f[1].pattern == "a filter set while a checkpoint is written"
                   for f in warnings.filters)
    finally:
        warnings.filters[:] = [f for f in warnings.filters if f[1] is None
                               or f[1].pattern != "a filter set while a checkpoint is written"]
