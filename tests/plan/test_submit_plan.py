"""`maester submit` plans a GPU job first: one predicted to run out of memory is refused with the plan's numbers,
`--force` submits it and the job directory keeps plan.json; `maester report` then puts the prediction beside what
the job measured."""

from __future__ import annotations

import json

import pytest

from maester import exit_codes
from maester.cli import main
from maester.plan.record import PLAN_FILE
from maester.tools.report import write_report
from tests.helpers import DEMO_CONFIG

# Two blocks of Llama 3 405B on one 80 GiB GPU: their 10.6B fp32 parameters, gradients and Adam state alone take
# 158 GiB (two blocks: planned in one step, no extrapolation in depth).
TOO_BIG = ["--model.name=llama", "--model.flavor=405B", '--model.overrides={"n_layers": 2}', "--data.seq_len=64", "--training.global_batch_size=2",
           "--training.micro_batch_size=2", "--slurm.nodes=1", "--slurm.gpus_per_node=1", "--slurm.gpu=h100"]


def test_submit_refuses_a_job_planned_to_run_out_of_memory_unless_forced(tmp_path, capsys):
    args = ["submit", "--no-submit", str(DEMO_CONFIG), "--name", "big", f"--job.dump_dir={tmp_path}", *TOO_BIG]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert "runs out of memory by" in err and "--force" in err and "optimizer state" in err, err
    assert "planned again" in err and "  --parallel." in err, err  # the changes that would fit, for the refusal
    assert not (tmp_path / "big").exists()  # nothing written

    main(args + ["--force"])
    job = tmp_path / "big"
    plan = json.loads((job / PLAN_FILE).read_text())
    assert plan["verdict"]["kind"] == "out_of_memory" and plan["gpus"] == 1 and plan["gpu"] == "H100"
    assert plan["peak_gib"] > 150

    # The job ran (two logged steps, as the trainer writes them): the report sets them beside the plan.
    predicted_tps = plan["throughput"]["tokens_per_second"]
    lines = [{"step": s, "loss": 5.0, "lr": 1e-3, "tokens_per_second": predicted_tps / 2, "peak_memory_gib": 75.0}
             for s in (1, 2)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = write_report(job).summary
    assert f"{plan['peak_gib']:.2f} GiB per rank predicted" in summary, summary
    assert f"measured 75.00 GiB, {75 / plan['peak_gib']:.2f}x the prediction" in summary, summary
    assert "0.50x the prediction" in summary, summary
