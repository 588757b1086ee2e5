"""Pre-tokenized sources (indexed, llm.c, nanoGPT): weighted, seeded, resumable, rank-independent windows."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from maester.config import DataConfig, DataSourceConfig, TokenizerConfig
from maester.data.batch import BatchPlan
from maester.data.indexed import IndexedDatasetWriter, write_llmc_shard
from maester.data.loader import build_loader
from maester.data.permutation import Permutation
from maester.data.token_loader import TokenLoader, source_format
from maester.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
EOS = TOK.eos_id


def write_indexed(prefix, docs: list[list[int]]) -> str:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def cfg(*sources, seq_len: int = 8, **kw) -> DataConfig:
    return DataConfig(sources=[s if isinstance(s, DataSourceConfig) else DataSourceConfig(path=str(s))
                               for s in sources], seq_len=seq_len, **kw)


def make(data: DataConfig, **kw) -> TokenLoader:
    kw = {"seed": 0, "global_batch": 4, "micro_batch": 2, "dp_rank": 0, "dp_size": 1, **kw}
    batch = BatchPlan(kw.pop("global_batch"), kw.pop("micro_batch"), kw.pop("dp_size"), kw.pop("dp_rank"))
    return build_loader(data, TokenizerConfig(kind="byte"), TOK, batch=batch, **kw)


def rows(ld) -> torch.Tensor:
    return torch.cat([torch.cat([b.input_ids, b.labels[:, -1:]], dim=1) for b in ld.next_step()])


def test_permutation_is_a_seeded_bijection_for_any_size():
    for n in (1, 2, 3, 10, 1000, 4097):
        values = Permutation(n, 7)[np.arange(n)]
        assert sorted(values.tolist()) == list(range(n))
    a, b = Permutation(1000, 1)[np.arange(1000)], Permutation(1000, 2)[np.arange(1000)]
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))
    assert Permutation(10**12, 3)[123456789] == Permutation(10**12, 3)[np.array([123456789])][0]
    with pytest.raises(IndexError):
        Permutation(5, 0)[5]


def test_windows_are_the_bin_in_seq_len_strides_and_each_is_taken_once_per_epoch(tmp_path):
    docs = [list(range(i * 10, i * 10 + 10)) for i in range(12)]  # 120 tokens
    prefix = write_indexed(tmp_path / "d_text_document", docs)
    assert source_format(DataSourceConfig(path=prefix)) == "indexed"
    ld = make(cfg(prefix, seq_len=8), global_batch=5, micro_batch=5)  # (120 - 1) // 8 = 14 windows
    stream = np.concatenate(docs)
    got = [tuple(r.tolist()) for _ in range(6) for r in rows(ld)]  # 30 windows: two epochs and two
    windows = {tuple(stream[i * 8:i * 8 + 9].tolist()) for i in range(14)}
    assert set(got[:14]) == windows and len(set(got[:14])) == 14
    assert set(got[14:28]) == windows and got[:14] != got[14:28]  # a new order in the second epoch


def test_weights_hold_within_two_percent_over_a_million_tokens(tmp_path):
    sources = []
    for value, weight in ((1, 0.6), (2, 0.3), (3, 0.1)):
        prefix = write_indexed(tmp_path / f"s{value}", [[value] * 997 for _ in range(30)])
        sources.append(DataSourceConfig(path=prefix, weight=weight))
    ld = make(cfg(*sources, seq_len=256), global_batch=16, micro_batch=16)
    counts, total = Counter(), 0
    while total < 1_000_000:
        (batch,) = ld.next_step()
        counts.update(batch.input_ids.flatten().tolist())
        total += batch.input_ids.numel()
    for value, weight in ((1, 0.6), (2, 0.3), (3, 0.1)):
        assert abs(counts[value] / total - weight) < 0.02
        assert abs(ld.source_metrics()[f"s{value}"]["tokens"] / total - weight) < 0.02


@pytest.mark.parametrize("stop", [1, 4, 9])
def test_resume_at_any_step_and_on_another_rank_count(tmp_path, stop):
    a = write_indexed(tmp_path / "a", [list(range(1, 40))] * 5)
    b = write_indexed(tmp_path / "b", [list(range(100, 133))] * 4)
    data = cfg(DataSourceConfig(path=a, weight=2), b, seq_len=7)
    whole = make(data, global_batch=8, micro_batch=2)
    expected = [rows(whole) for _ in range(stop + 6)]
    four = [make(data, global_batch=8, micro_batch=1, dp_rank=r, dp_size=4) for r in range(4)]
    for k in range(stop):
        assert torch.equal(torch.cat([rows(ld) for ld in four]), expected[k])
    state = json.loads(json.dumps(four[0].state_dict()))
    two = [make(data, global_batch=8, micro_batch=4, dp_rank=r, dp_size=2) for r in range(2)]
    for ld in two:
        ld.load_state_dict(state)
    for k in range(stop, stop + 6):
        assert torch.equal(torch.cat([rows(ld) for ld in two]), expected[k])


def test_resume_refuses_other_data_or_seed(tmp_path):
    a = write_indexed(tmp_path / "a", [list(range(1, 40))] * 3)
    b = write_indexed(tmp_path / "b", [list(range(1, 41))] * 3)
    ld = make(cfg(a))
    ld.next_step()
    with pytest.raises(ValueError, match="different data or another seed"):
        make(cfg(b)).load_state_dict(ld.state_dict())
    with pytest.raises(ValueError, match="different data or another seed"):
        make(cfg(a), seed=5).load_state_dict(ld.state_dict())


def test_document_masking_follows_the_index_boundaries(tmp_path):
    prefix = write_indexed(tmp_path / "d", [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16]])  # no EOS in the data
    ld = make(cfg(prefix, seq_len=11, document_masking=True), global_batch=1, micro_batch=1)
    (batch,) = ld.next_step()
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert batch.document_ids[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5]


def test_llmc_shards_and_nanogpt_bins(tmp_path):
    for i in range(3):
        write_llmc_shard(tmp_path / f"fineweb_train_{i:06d}.bin", np.arange(i * 50, i * 50 + 50) % 256)
    pattern = str(tmp_path / "fineweb_train_*.bin")
    assert source_format(DataSourceConfig(path=pattern)) == "llmc"
    ld = make(cfg(pattern, seq_len=7), global_batch=21, micro_batch=21)  # 3 shards x 7 windows
    got = rows(ld)
    for r in got.tolist():  # a window never spans two shards
        assert r == list(range(r[0], r[0] + 8))
    assert len({tuple(r) for r in got.tolist()}) == 21

    nano = tmp_path / "train.bin"
    np.arange(1000, dtype="<u2").tofile(nano)
    with pytest.raises(ValueError, match="set format = 'nanogpt'"):
        make(cfg(nano))
    with pytest.raises(ValueError, match="token id 269 at token 269"):  # ids of another tokenizer
        make(cfg(DataSourceConfig(path=str(nano), format="nanogpt"), seq_len=9))
    (np.arange(1000, dtype="<u2") % 256).tofile(nano)
    ld = make(cfg(DataSourceConfig(path=str(nano), format="nanogpt"), seq_len=9))
    assert all(r == [t % 256 for t in range(r[0], r[0] + 10)] for r in rows(ld).tolist())


def test_validation_tail_is_held_out(tmp_path):
    prefix = write_indexed(tmp_path / "d", [list(range(200))])
    data = cfg(DataSourceConfig(path=prefix, validation_fraction=0.25), seq_len=9)  # 22 windows, 6 held out
    ld = make(data, global_batch=4, micro_batch=4)
    trained = {r[0] for _ in range(8) for r in rows(ld).tolist()}
    assert trained == {i * 9 for i in range(16)}
    val = ld.validation_batches(micro_batch=4)
    assert sorted(b.input_ids[i, 0].item() for b in val for i in range(len(b.input_ids))) == [i * 9 for i in range(16, 22)]


def test_too_little_data_and_mixed_kinds_are_errors(tmp_path):
    prefix = write_indexed(tmp_path / "d", [list(range(5))])
    with pytest.raises(ValueError, match="nothing to train on"):
        make(cfg(prefix, seq_len=8))
    (tmp_path / "t.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="mixes raw text and pre-tokenized"):
        make(cfg(prefix, tmp_path / "t.jsonl"))
