"""lm-eval's `custom_dataset` for the task YAMLs of this directory: the JSONL file a YAML names, read from beside
this file (not from the working directory), as the `test` split. No download, no `datasets` cache."""

import json
from pathlib import Path


def jsonl_beside(file: str, **_metadata):
    import datasets

    path = Path(__file__).parent / file
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
