"""Token ids of every pre-tokenized source are checked against the tokenizer's vocabulary on the host: a bad id is
an error naming the file and the position, never an index error in the embedding (a device-side assert on a GPU).
Ids between the tokenizer's vocabulary and the model's padded embedding rows count as bad too."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from maester.config import DataConfig, DataSourceConfig, TokenizerConfig
from maester.data.indexed import IndexedDatasetWriter, write_llmc_shard
from maester.data.loader import build_loader
from maester.data.tokenizers import ByteTokenizer
from maester.data import token_loader
from maester.data.batch import BatchPlan
from tests.data.test_sft import TOKENIZER, data_config, loader, write_conversations
from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides

TOK = ByteTokenizer()
BAD = 300  # > the byte tokenizer's 269 ids, < the tiny model's padded embedding rows


def stream(n: int = 4000, bad_at: int | None = None) -> np.ndarray:
    tokens = (np.arange(n) % 250).astype(np.uint16)
    if bad_at is not None:
        tokens[bad_at] = BAD
    return tokens


def write(kind: str, path, tokens: np.ndarray) -> str:
    if kind == "indexed":
        with IndexedDatasetWriter(path, np.uint16) as w:
            w.add_document(tokens)
        return str(path)
    if kind == "llmc":
        write_llmc_shard(f"{path}.bin", tokens)
        return f"{path}.bin"
    tokens.tofile(f"{path}.bin")
    return f"{path}.bin"


def make(path: str, kind: str):
    source = DataSourceConfig(path=path, format="nanogpt" if kind == "nanogpt" else "auto")
    return build_loader(DataConfig(sources=[source], seq_len=32), TokenizerConfig(kind="byte"), TOK, seed=0,
                        batch=BatchPlan(4, 2))


@pytest.mark.parametrize("kind", ["indexed", "llmc", "nanogpt"])
def test_bad_id_is_refused_at_open_naming_file_and_position(tmp_path, kind):
    path = write(kind, tmp_path / "data", stream(bad_at=1234))
    with pytest.raises(ValueError, match=rf"data\.bin: token id {BAD} at token 1,234 is outside the tokenizer's "
                                         rf"vocabulary of {TOK.vocab_size} ids"):
        make(path, kind)


@pytest.mark.parametrize("kind", ["indexed", "nanogpt"])
def test_large_files_are_checked_window_by_window(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(token_loader, "OPEN_SCAN_TOKENS", 100)  # as if the file were too big to scan at open
    path = write(kind, tmp_path / "data", stream(bad_at=3000))
    ld = make(path, kind)
    with pytest.raises(ValueError, match=rf"token id {BAD} at token 3,000 is outside"):
        for _ in range(40):  # every window is taken within the first epoch
            ld.next_step()


def test_clean_files_load(tmp_path):
    for kind in ("indexed", "llmc", "nanogpt"):
        ld = make(write(kind, tmp_path / kind, stream()), kind)
        assert int(ld.next_step()[0].input_ids.max()) < TOK.vocab_size


def test_packed_sft_rows_are_checked(tmp_path):
    from maester.tools.data_pack import pack

    write_conversations(tmp_path / "chats.jsonl", 20)
    pack([str(tmp_path / "chats.jsonl")], str(tmp_path / "packed"), TOKENIZER, seq_len=320, seed=5)
    file = next((tmp_path / "packed").glob("*.parquet"))
    table = pq.read_table(file)
    rows = [list(r) for r in table.column("input_ids").to_pylist()]
    rows[1][7] = BAD
    import pyarrow as pa

    column = pa.array(rows, type=table.schema.field("input_ids").type)
    pq.write_table(table.set_column(table.schema.get_field_index("input_ids"), "input_ids", column), file)
    with pytest.raises(ValueError, match=rf"{file.name}: row 1, input_ids\[7\] = {BAD} is outside"):
        loader(data_config({"path": str(tmp_path / "packed")}))


def test_training_on_a_bad_nanogpt_bin_is_a_one_line_error(tmp_path):
    path = write("nanogpt", tmp_path / "data", stream(20000, bad_at=17000))
    args = tiny_overrides(tmp_path / "unused.parquet", tmp_path / "jobs", "x", training__steps=4)
    args = [a for a in args if not a.startswith("--data.sources")]
    args += [f'--data.sources=[{{"path":"{path}","format":"nanogpt"}}]', "--tokenizer.kind=byte"]
    out = run_maester(["train", str(DEMO_CONFIG), *args], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "IndexError" not in out.stderr
    assert f"data.bin: token id {BAD} at token 17,000" in out.stderr
