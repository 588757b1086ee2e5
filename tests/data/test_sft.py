"""The SFT loader: every conversation whole and once per epoch, exact resume on any rank count, weights,
validation split, bad records, and packed rows that compute the same losses as each conversation alone."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from maester.config import DataConfig, SFTConfig, TokenizerConfig
from maester.data.batch import IGNORE_INDEX, BatchPlan
from maester.data.chat import ChatEncoder
from maester.data.sft_loader import SFTLoader
from maester.data.tokenizers import ByteTokenizer

WORDS = "the cat sat on a mat while every dog ran far away from home and back again".split()
TOKENIZER = TokenizerConfig(kind="byte")


def conversation(rng: random.Random) -> list[dict]:
    turns = []
    for _ in range(rng.randint(1, 3)):
        turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))})
        turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
    return turns


def write_conversations(path, n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    convs = [conversation(rng) for _ in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return convs


def data_config(*sources: dict, seq_len: int = 320, **kw) -> DataConfig:
    return DataConfig(mode="sft", sources=list(sources), seq_len=seq_len, **kw)


def loader(data: DataConfig, global_batch=4, micro_batch=2, rank=0, size=1, seed=0) -> SFTLoader:
    return SFTLoader(data, TOKENIZER, ByteTokenizer(), seed=seed,
                     batch=BatchPlan(global_batch, micro_batch, size, rank))


def documents(batches) -> list[tuple[tuple, tuple]]:
    """(tokens, labels) of every packed document in the micro-batches, read back through document_ids."""
    out = []
    for b in batches:
        for r in range(b.input_ids.shape[0]):
            ids = b.document_ids[r]
            for d in ids.unique().tolist():
                if d < 0:
                    continue
                where = ids == d
                pos = torch.nonzero(where).flatten()
                assert torch.equal(pos, torch.arange(pos[0], pos[-1] + 1)), "a document is not contiguous"
                assert torch.equal(b.position_ids[r][where], torch.arange(len(pos))), "positions do not restart"
                out.append((tuple(b.input_ids[r][where].tolist()), tuple(b.labels[r][where].tolist())))
    return out


def expected(convs) -> Counter:
    enc = ChatEncoder(ByteTokenizer(), SFTConfig())
    out = Counter()
    for c in convs:
        e = enc.encode(c)
        out[(tuple(e.tokens.tolist()), tuple(e.labels().tolist()))] += 1
    return out


def test_every_conversation_once_per_epoch_whole_and_labelled(tmp_path):
    convs = write_conversations(tmp_path / "chats.jsonl", 80)
    ld = loader(data_config({"path": str(tmp_path / "chats.jsonl")}), global_batch=1, micro_batch=1)
    rows = len(ld.plan(0))
    assert rows < 80  # several conversations share a row
    seen = Counter(documents([b for _ in range(rows) for b in ld.next_step()]))
    assert ld.epoch == 1 and ld.offset == 0
    assert seen == expected(convs)
    # the next epoch has them all again, in another order
    first_of_epoch1 = documents(ld.next_step())
    assert all(d in expected(convs) for d in first_of_epoch1)


def test_padding_has_no_labels_and_its_own_document_id(tmp_path):
    write_conversations(tmp_path / "chats.jsonl", 30)
    ld = loader(data_config({"path": str(tmp_path / "chats.jsonl")}), global_batch=4, micro_batch=4)
    (batch,) = ld.next_step()
    pad = batch.document_ids == -1
    assert pad.any()
    assert (batch.labels[pad] == IGNORE_INDEX).all() and (batch.input_ids[pad] == ByteTokenizer().pad_id).all()
    assert int(batch.document_lengths.sum()) == int((~pad).sum())


def steps(ld, n) -> list[tuple]:
    out = []
    for _ in range(n):
        out += [tuple(map(tuple, b.input_ids.tolist())) for b in ld.next_step()]
    return out


def test_resume_exactly_also_on_another_number_of_ranks(tmp_path):
    write_conversations(tmp_path / "chats.jsonl", 50)
    data = data_config({"path": str(tmp_path / "chats.jsonl")})
    ref = loader(data)
    steps(ref, 7)  # crosses into the second epoch: 7 x 4 rows > rows of one epoch
    assert len(ref.plan(0)) < 28
    state = json.loads(json.dumps(ref.state_dict()))
    expect = steps(ref, 5)

    again = loader(data)
    again.load_state_dict(state)
    assert steps(again, 5) == expect

    halves = [loader(data, global_batch=4, micro_batch=1, rank=r, size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    got = []
    for _ in range(5):
        per_rank = [[tuple(map(tuple, b.input_ids.tolist())) for b in h.next_step()] for h in halves]
        got += [row for part in per_rank for mb in part for row in mb]
    assert got == [row for mb in expect for row in mb]


def test_resume_refuses_other_data(tmp_path):
    write_conversations(tmp_path / "a.jsonl", 20)
    write_conversations(tmp_path / "b.jsonl", 20, seed=1)
    state = loader(data_config({"path": str(tmp_path / "a.jsonl")})).state_dict()
    with pytest.raises(ValueError, match="different SFT data"):
        loader(data_config({"path": str(tmp_path / "b.jsonl")})).load_state_dict(state)


def test_seed_changes_the_order_not_the_content(tmp_path):
    write_conversations(tmp_path / "chats.jsonl", 40)
    data = data_config({"path": str(tmp_path / "chats.jsonl")})
    a, b = loader(data, global_batch=1, micro_batch=1), loader(data, global_batch=1, micro_batch=1, seed=1)
    rows = len(a.plan(0))
    da = [d for _ in range(rows) for d in documents(a.next_step())]
    db = [d for _ in range(len(b.plan(0))) for d in documents(b.next_step())]
    assert Counter(da) == Counter(db) and da != db


def test_weights_repeat_and_subsample_per_epoch(tmp_path):
    a = write_conversations(tmp_path / "a.jsonl", 20)
    b = write_conversations(tmp_path / "b.jsonl", 20, seed=1)
    ld = loader(data_config({"path": str(tmp_path / "a.jsonl"), "weight": 2.0},
                            {"path": str(tmp_path / "b.jsonl"), "weight": 0.5}), global_batch=1, micro_batch=1)
    seen = Counter(d for _ in range(len(ld.plan(0))) for d in documents(ld.next_step()))
    ea, eb = expected(a), expected(b)
    assert all(seen[k] == 2 * v for k, v in ea.items())
    assert sum(seen[k] for k in eb) == 10 and all(seen[k] <= v for k, v in eb.items())
    metrics = ld.source_metrics()
    assert metrics["a.jsonl"]["conversations"] == 40 and metrics["b.jsonl"]["conversations"] == 10


def test_validation_split_is_held_out_and_shared_by_ranks(tmp_path):
    convs = write_conversations(tmp_path / "chats.jsonl", 120)
    data = data_config({"path": str(tmp_path / "chats.jsonl"), "validation_fraction": 0.2})
    ld = loader(data, global_batch=1, micro_batch=1)
    trained = Counter(d for _ in range(len(ld.plan(0))) for d in documents(ld.next_step()))
    ranks = [loader(data, global_batch=2, micro_batch=1, rank=r, size=2).validation_batches(3) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) > 0  # every rank runs the same number of forwards
    held = Counter(documents(ranks[0]) + documents(ranks[1]))
    assert 10 < sum(held.values()) < 40
    assert not set(held) & set(trained)
    assert held + trained == expected(convs)


def test_bad_record_is_named_or_skipped_and_counted(tmp_path):
    path = tmp_path / "chats.jsonl"
    write_conversations(path, 10)
    with open(path, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:11"):
        loader(data_config({"path": str(path)}))
    ld = loader(data_config({"path": str(path)}, skip_invalid=True))
    assert ld.source_metrics()["chats.jsonl"]["skipped"] == 1


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path):
    path = tmp_path / "chats.jsonl"
    convs = write_conversations(path, 20)
    long = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 400}]
    with open(path, "a") as f:
        f.write(json.dumps({"messages": long}) + "\n")
    cut = loader(data_config({"path": str(path)}, seq_len=128), global_batch=1, micro_batch=1)
    assert cut.source_metrics()["chats.jsonl"]["truncated"] >= 1
    seen = [d for _ in range(len(cut.plan(0))) for d in documents(cut.next_step())]
    assert max(len(t) for t, _ in seen) == 128 and all(lab[-1] == IGNORE_INDEX for _, lab in seen)
    dropped = loader(data_config({"path": str(path)}, seq_len=128, sft=SFTConfig(overlong="drop")))
    counts = dropped.source_metrics()["chats.jsonl"]
    assert counts["dropped"] >= 1 and counts["kept"] + counts["dropped"] == len(convs) + 1


def per_token_losses(model, batch) -> torch.Tensor:
    logits = model(batch.input_ids, batch.position_ids, batch.document_ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(batch.labels.shape)


def test_packed_rows_give_each_conversation_its_own_losses(tmp_path):
    """Masking, positions and label alignment together: a packed row's per-token losses equal those of each of its
    conversations run alone, and without the document mask they would not: `leaky` is the row as upstream GPT-NeoX
    trains packed SFT samples (a plain causal mask, positions counting over the row), the caveat of
    docs/data-tools.md."""
    from tests.models.test_llama import tiny_model

    write_conversations(tmp_path / "chats.jsonl", 40)
    ld = loader(data_config({"path": str(tmp_path / "chats.jsonl")}, seq_len=320), global_batch=2, micro_batch=2)
    model = tiny_model(seed=3)
    (batch,) = ld.next_step()
    with torch.no_grad():
        packed = per_token_losses(model, batch)
        leaky = F.cross_entropy(model(batch.input_ids).flatten(0, 1).float(), batch.labels.flatten(),
                                ignore_index=IGNORE_INDEX, reduction="none").view(batch.labels.shape)
        checked = 0
        for r in range(batch.input_ids.shape[0]):
            for d in batch.document_ids[r].unique().tolist():
                if d < 0:
                    continue
                where = batch.document_ids[r] == d
                ids, labels = batch.input_ids[r][where][None], batch.labels[r][where][None]
                logits = model(ids)  # alone: positions 0..n-1, causal
                alone = F.cross_entropy(logits[0].float(), labels[0], ignore_index=IGNORE_INDEX, reduction="none")
                torch.testing.assert_close(packed[r][where], alone, rtol=1e-4, atol=1e-5)
                checked += 1
    assert checked >= 3
    later = batch.document_ids > 0  # documents after the first of a row see the others without the mask
    assert not torch.allclose(packed[later], leaky[later], rtol=1e-3, atol=1e-3)
    assert (batch.labels != IGNORE_INDEX).sum() > 0 and np.isfinite(packed.sum().item())


def test_rows_packed_offline_train_the_same_conversations(tmp_path):
    """`maester data pack` output as a source: the same documents and labels as packing on the fly, and a packed
    file of another seq_len is refused."""
    from maester.tools.data_pack import pack

    convs = write_conversations(tmp_path / "chats.jsonl", 60)
    pack([str(tmp_path / "chats.jsonl")], str(tmp_path / "packed"), TOKENIZER, seq_len=320, seed=5)
    ld = loader(data_config({"path": str(tmp_path / "packed")}), global_batch=1, micro_batch=1)
    rows = len(ld.plan(0))
    seen = Counter(d for _ in range(rows) for d in documents(ld.next_step()))
    assert seen == expected(convs)
    assert ld.source_metrics()["packed"]["conversations"] == 60
    with pytest.raises(ValueError, match="packed to seq_len 320"):
        loader(data_config({"path": str(tmp_path / "packed")}, seq_len=256))


def test_rows_packed_with_another_tokenizer_are_refused(tmp_path):
    from maester.tools.data_pack import pack
    from tests.data.test_chat import write_hf

    write_conversations(tmp_path / "chats.jsonl", 10)
    hf = write_hf(tmp_path / "hf")
    pack([str(tmp_path / "chats.jsonl")], str(tmp_path / "packed"), TokenizerConfig(kind="hf", path=str(hf)),
         seq_len=320)
    with pytest.raises(ValueError, match="packed with tokenizer hf"):
        loader(data_config({"path": str(tmp_path / "packed")}))


def test_encoding_in_worker_processes_changes_nothing(tmp_path):
    write_conversations(tmp_path / "chats.jsonl", 600)  # more than one chunk of records
    one = loader(data_config({"path": str(tmp_path / "chats.jsonl")}, num_workers=1))
    two = loader(data_config({"path": str(tmp_path / "chats.jsonl")}, num_workers=2))
    assert one.state_dict()["fingerprint"] == two.state_dict()["fingerprint"]
    assert steps(one, 3) == steps(two, 3)
