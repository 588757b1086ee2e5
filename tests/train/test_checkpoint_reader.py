"""The one-pass load: a tensor record of DCP is read as a view of its file's bytes (equal to what torch.load gives,
for every layout torch.save writes), anything else through torch.load; a load checks its files' checksums in the
same pass and names a damaged file after writing the state; the files to check are shared out over the ranks that
read them, the small shared files on rank 0."""

from __future__ import annotations

import io
import mmap
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from maester.config import CheckpointConfig
from maester.train.checkpoint import Checkpointer
from maester.train.checkpoint_reader import DamagedCheckpoint, OnePassReader, _tensor_in_record
from tests.train.test_checkpoint_digests import cut_short, flip_a_bit, tiny

LAYOUTS = {
    "float32": lambda: torch.randn(5, 7),
    "bfloat16": lambda: torch.randn(3, 4).to(torch.bfloat16),
    "int64": lambda: torch.arange(11),
    "bool": lambda: torch.rand(9) > 0.5,
    "a scalar": lambda: torch.tensor(3.5),
    "a view with an offset (the whole storage is saved)": lambda: torch.randn(8, 6)[2:5],
    "transposed": lambda: torch.randn(4, 6).t(),
}


def records(tensors: list[torch.Tensor]) -> tuple[bytes, list[tuple[int, int]]]:
    """torch.save records one after another, as DCP writes them into one file: the bytes and (offset, length)."""
    out, spans = io.BytesIO(), []
    out.write(b"x" * 13)  # records start anywhere in a file, not at aligned offsets
    for tensor in tensors:
        start = out.tell()
        torch.save(tensor, out)
        spans.append((start, out.tell() - start))
    return out.getvalue(), spans


def test_a_record_is_read_as_a_view_of_its_bytes_equal_to_torch_load():
    tensors = [make() for make in LAYOUTS.values()]
    data, spans = records(tensors)
    buffer = mmap.mmap(-1, len(data))
    buffer.write(data)
    for name, tensor, (start, length) in zip(LAYOUTS, tensors, spans):
        view = _tensor_in_record(buffer, start, length)
        assert view is not None, name
        loaded = torch.load(io.BytesIO(data[start:start + length]), weights_only=True)
        assert view.dtype == loaded.dtype and view.shape == loaded.shape and view.stride() == loaded.stride(), name
        assert torch.equal(view, loaded), name
        inside = view.untyped_storage().data_ptr() - _address(buffer)
        assert start < inside < start + length  # no copy: the mapping's own bytes
        del view


def _address(buffer) -> int:
    return torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()


def test_anything_but_a_plain_tensor_record_is_left_to_torch_load():
    data, [(start, length)] = records([torch.nn.Parameter(torch.randn(3))])
    assert _tensor_in_record(data, start, length) is None
    data, [(start, length)] = records([torch.randn(3)])
    assert _tensor_in_record(data[:-1], start, length - 1) is None  # not a whole zip


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    model, optimizer = tiny()
    return Checkpointer(tmp_path_factory.mktemp("reader"), CheckpointConfig()).save(
        1, model, optimizer, {"tokens_seen": 1, "data": {}}, "{}")


def test_a_load_equals_the_saved_state_and_checks_every_file_in_the_same_pass(saved, tmp_path):
    reference, reference_optimizer = tiny()
    path = Path(shutil.copytree(saved, tmp_path / saved.name))
    model, optimizer = tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.load(path, model, optimizer, "continue", verify=True)
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(reference_optimizer.state.values(), optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for name, damage in (("__0_0.distcp", flip_a_bit), ("rng/rank0.pt", flip_a_bit), (".metadata", cut_short)):
        copy = Path(shutil.copytree(saved, tmp_path / f"{name.replace('/', '_')}-{damage.__name__}"))
        damage(copy / name)
        with pytest.raises(DamagedCheckpoint) as found:
            checkpointer.load(copy, model, optimizer, "continue", verify=True)
        assert found.value.problems[0].startswith(f"{copy / name}: "), found.value.problems


def test_the_files_to_check_are_shared_out_over_the_ranks_that_read_them(saved):
    """Each manifest file is checked by one rank: a data file by the rank reading it (the least loaded of several
    readers), one nobody reads by the least loaded rank, the small shared files by rank 0 (and .metadata by every
    rank, from the bytes it unpickles)."""
    expected = {".metadata": (100, "xxh3_128", ""), "trainer_state.json": (10, "xxh3_128", ""),
                "rng/rank1.pt": (10, "xxh3_128", ""), "__0_0.distcp": (1000, "xxh3_128", ""),
                "__1_0.distcp": (1000, "xxh3_128", ""), "__2_0.distcp": (900, "xxh3_128", ""),
                "__3_0.distcp": (50, "xxh3_128", "")}
    reader = OnePassReader(saved, expected)

    class Where:
        def __init__(self, name):
            self.relative_path = name

    files = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    reader.storage_data = {MetadataIndex(f"w{i}"): Where(name) for i, name in enumerate(files)}

    def reads(*indices):
        return LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex(f"w{i}"), (0,), MetadataIndex(f"w{i}"), (0,),
                                  (1,)) for i in indices])

    # rank 0 reads file 0, rank 1 reads files 1 and 2 (resharded: rank 0 reads a part of file 2 too), rank 2 nothing
    duty = [plan.storage_data for plan in reader.prepare_global_plan([reads(0, 2), reads(1, 2), reads()])]
    assert sorted(name for names in duty for name in names) == sorted(set(expected) - {".metadata"})  # each once
    assert set(duty[0]) == {"__0_0.distcp", "__2_0.distcp", "trainer_state.json", "rng/rank1.pt"}
    assert duty[1] == ["__1_0.distcp"] and duty[2] == ["__3_0.distcp"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_copies_from_the_mapped_file_into_cuda_destinations(saved, tmp_path):
    """On a GPU the destinations are device tensors: the copy from the mapping is a host-to-device copy."""
    reference, _ = tiny()
    model, optimizer = tiny()
    model.cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    Checkpointer(tmp_path, CheckpointConfig()).load(saved, model, None, "model_only", verify=True)
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        assert b.is_cuda and torch.equal(a, b.cpu()), name
