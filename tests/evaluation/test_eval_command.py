"""`maester eval`: the same results from two processes as from one, task files by path or by an include directory,
bad tasks refused before the model loads, and a clear message where lm-eval is not installed."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from maester import exit_codes
from tests.evaluation.conftest import LIMIT, OFFLINE, TASKS, run_eval
from tests.helpers import REPO, clean_env, torchrun


def test_two_processes_give_the_results_of_one(eval_job, one_process_eval, tmp_path):
    one, _ = one_process_eval
    out = torchrun(2, ["eval", str(eval_job[0]), "--tasks", TASKS, "--limit", LIMIT, "--batch-size", "2",
                       "--output", str(tmp_path / "two.json"), "--log-samples"], REPO,
                   env=clean_env(**OFFLINE, HF_HOME=str(tmp_path / "hf-home")), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("|pydoc_choice  |") == 1  # rank 0 prints the table, once
    two = json.loads((tmp_path / "two.json").read_text())
    for task in ("pydoc_choice", "pydoc_complete"):
        assert two["results"][task] == one["results"][task]
        mine = {s["doc_id"]: s["resps"] for s in two["samples"][task]}
        assert {s["doc_id"]: s["resps"] for s in one["samples"][task]}.keys() == mine.keys()
        for sample in one["samples"][task]:
            theirs = mine[sample["doc_id"]]
            if isinstance(theirs[0][0], str):
                assert theirs == sample["resps"]
            else:  # other batches, other padding: the same numbers to float32 rounding
                assert [r[0][0] for r in theirs] == pytest.approx([r[0][0] for r in sample["resps"]], rel=1e-5)
    assert (one["config"]["processes"], two["config"]["processes"]) == (1, 2)
    assert "pretty_env_info" in one  # lm-eval's JSON in full, environment included (the training loop skips it)


def test_task_files_by_path_and_by_include_directory(eval_job, tmp_path):
    from maester.evaluation.task_specs import SHIPPED_TASKS

    mine = tmp_path / "tasks"
    mine.mkdir()
    for name in ("data.py", "pydoc_choice.jsonl"):
        shutil.copy(SHIPPED_TASKS / name, mine / name)
    yaml = (SHIPPED_TASKS / "pydoc_choice.yaml").read_text().replace("task: pydoc_choice", "task: my_choice")
    (mine / "my_choice.yaml").write_text(yaml)
    printed = run_eval([eval_job[0], "--tasks", mine / "my_choice.yaml", "--limit", "3", "--output",
                        tmp_path / "by-path.json"], tmp_path)
    assert "|my_choice|" in printed
    run_eval([eval_job[0], "--tasks", "my_choice", "--include-path", mine, "--limit", "3", "--output",
              tmp_path / "by-name.json"], tmp_path)
    by_path, by_name = (json.loads((tmp_path / f).read_text())["results"] for f in ("by-path.json", "by-name.json"))
    assert by_path["my_choice"]["acc,none"] == by_name["my_choice"]["acc,none"]


def test_download_only_loads_the_tasks_without_a_model(tmp_path):
    printed = run_eval(["--download-only", "--tasks", "pydoc_choice,pydoc_complete"], tmp_path)
    assert printed.splitlines() == ["pydoc_choice: 100 documents to evaluate",
                                    "pydoc_complete: 100 documents to evaluate"]


@pytest.mark.parametrize("tasks, message", [
    ("missing.yaml", "--tasks: the task file missing.yaml does not exist"),
    ("pydoc_choice,", None),  # a trailing comma is not a task
])
def test_bad_tasks_are_refused_before_the_model_loads(tmp_path, capsys, tasks, message):
    from maester.cli import main

    if message is None:  # refused for the missing job instead: the task list itself was fine
        message = "no checkpoint at"
    with pytest.raises(SystemExit) as e:
        main(["eval", str(tmp_path / "no-job"), "--tasks", tasks])
    assert e.value.code == exit_codes.BAD_INPUT
    assert message in capsys.readouterr().err


def test_without_lm_eval_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    from maester.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: `import lm_eval` raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["eval", str(tmp_path), "--tasks", "pydoc_choice"])
    assert e.value.code == exit_codes.BAD_INPUT
    assert "pip install 'maester[eval]'" in capsys.readouterr().err
