import os

import pytest

from tests.helpers import write_corpus

# Every metrics.jsonl row and events.jsonl line the suite writes is checked against the documented schema
# (maester.train.metrics_file), in this process and in the runs it starts.
os.environ["_MAESTER_CHECK_RECORDS"] = "1"


@pytest.fixture
def corpus(tmp_path):
    """A real Parquet file of short pseudo-English documents."""
    return write_corpus(tmp_path / "data" / "corpus.parquet")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Built-in corpora and other caches go to the test's own directory, never the user's home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
