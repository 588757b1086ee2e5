"""GPU check: one command that gives a verdict on a GPU machine, also a bare one (its own python3 and torch, no uv,
no network), within a time budget. Run it through `scripts/gpu-check.sh`; docs/gpu-first-run.md says what to run
first and how to read the report.

    scripts/gpu-check.sh --prepare      # where the package index is: wheels for cp311 and cp312, the plan's peaks
    scripts/gpu-check.sh [--out DIR] [--stages a,b] [--budget SECONDS]
    scripts/gpu-check.sh --dry-run      # every stage's setup up to its first use of a GPU

Stages run in the order of STAGES, the most informative first; each writes its result into DIR/gpu-check.json as
soon as it ends (a check killed at its time limit still reports what it reached), with its measured seconds. A
stage passes, fails with its reason, or is not run ("skip": needs more GPUs, or the budget is spent); only a pass
counts as one. The default budget keeps the whole check, its setup included, within one 10-minute device call.
Without a usable GPU the check refuses (exit 2) rather than check the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from gpu_check_wheels import PLATFORMS, PYTHON_VERSIONS, WHEELS, expected_peak, install_wheels, prepare

REPO = Path(__file__).resolve().parents[1]
HARNESS = "benchmarks/gpu_check_train.py"
RESULT = "GPU_CHECK_RESULT"
TORCH_FLOOR = (2, 10)
DEVICE_CALL = 600
"""Seconds of one call on a device machine, everything included: the default budget leaves the setup and a
margin out of it."""
SETUP_SECONDS = 45  # before the first stage: torch's import, the wheels' install, the data, the allocation probe
DEFAULT_BUDGET = DEVICE_CALL - SETUP_SECONDS - 45
INTERRUPT_GRACE = 10
"""Seconds a stage has after SIGINT at its time limit to write what it has (pytest's report) before it is killed."""
FIRST_ALLOCATION = "import torch; torch.ones(1, device='cuda').sum().item()"


@dataclass
class Stage:
    name: str
    proves: str
    kind: str  # "train": the one-rank FSDP harness; "pytest"; "torchrun"
    args: list[str] = field(default_factory=list)
    estimate: float = 60  # seconds on one H100, import and compile included: a stage starts only with this left
    timeout: float = 300
    gpus: int = 1
    expect: dict = field(default_factory=dict)
    harness: str = HARNESS  # "train": the script that runs it and prints the RESULT line
    on_request: bool = False  # run only when --stages names it (beyond the default budget); the dry run sets it up
    planned: bool = False  # its peak memory beside `maester plan`'s, planned at --prepare (gpu_check_wheels)


def jsonl_source(name: str) -> str:
    return f'--data.sources=[{{"path": "{{data}}/{name}.jsonl"}}]'


# A few steps of each; logging at the first and last step only, so every step between them must not synchronise.
FEW = ["--tokenizer.kind=byte", "--tokenizer.path=null", "--schedule.warmup_steps=1", "--logging.eval_interval=0",
       "--parallel.force_fsdp=true", "--training.device=cuda", "--checkpoint.init_from=null"]
DEMO = ["configs/demo.toml", *FEW, jsonl_source("pydoc"), "--training.steps=8", "--logging.interval=8",
        "--checkpoint.interval=0", "--checkpoint.save_final=true"]
MODES = ["configs/demo.toml", *FEW, jsonl_source("pydoc"), "--model.flavor=tiny", "--data.seq_len=256",
         "--training.steps=6", "--logging.interval=6", "--training.global_batch_size=8",
         "--training.micro_batch_size=4", "--checkpoint.interval=3"]


def two_ranks(base: list[str], *layout: str) -> list[str]:
    """A torchrun stage's args: the process count, then `base` on its own layout (no one-rank FSDP)."""
    return ["2", *[a for a in base if a != "--parallel.force_fsdp=true"], *layout]


STAGES = [
    Stage("fsdp-sync", "NCCL+gloo backend map, DeviceMesh and FSDP2 on CUDA, DCP on device tensors, and no "
          "synchronisation on a step that neither logs nor saves", "train", DEMO, estimate=30, timeout=150),
    Stage("gemma3-1b-sft", "the shipped Gemma 3 1B SFT shape (seq 4096, micro 4, selective AC, compile, FlexAttention "
          "at head_dim 256 with document masks, chunked loss at V=262k) fits one GPU, with a memory snapshot",
          "train", ["configs/gemma3/1b-sft.toml", *FEW, jsonl_source("pydoc-chat"), "--data.sft.template=chatml",
                    "--training.steps=4", "--logging.interval=4", "--training.global_batch_size=8",
                    "--checkpoint.interval=0", "--checkpoint.save_final=false", "--profiling.memory_snapshot=true",
                    "--profiling.memory_snapshot_max_entries=20000", "--profiling.start_step=3",
                    "--profiling.steps=1"],
          estimate=140, timeout=360, planned=True),
    Stage("llama3-8b-width", "Llama 3 8B width (4 layers) at seq 8192: cuDNN/flash SDPA inside compiled selective AC; "
          "tokens/s and MFU at the real width", "train",
          ["configs/llama3/8b.toml", *FEW, jsonl_source("pydoc"), '--model.overrides={"n_layers": 4}',
           "--training.steps=6", "--logging.interval=6", "--training.global_batch_size=2",
           "--checkpoint.interval=0", "--checkpoint.save_final=false"],
          estimate=80, timeout=300, planned=True),
    Stage("olmoe-width", "OLMoE 1B-7B width (2 layers): the experts under FSDP mixed precision, full AC, z-loss; "
          "torch._grouped_mm forward and backward where the GPU has its grouped kernel (H100, B200), else the "
          "experts' loop with its one host read per MoE layer and forward, allowed and said in the figures",
          "train", ["configs/olmoe/1b-7b.toml", *FEW, jsonl_source("pydoc"), "--parallel.ep=1",
                    '--model.overrides={"n_layers": 2, "moe": {"z_loss_coef": 0.001}}', "--training.steps=6",
                    "--logging.interval=6", "--training.global_batch_size=8", "--checkpoint.interval=0",
                    "--checkpoint.save_final=false"],
          estimate=50, timeout=240, planned=True),
    # Ahead of the three short modes: the only stage with the GPU kernels' tests, reached within the default budget.
    Stage("cuda-tests", "every test marked cuda (kernels, routing, grouped GEMM, profiler, precision) passes",
          "pytest", estimate=120, timeout=360),
    Stage("cpu-offload", "FSDP2 CPU offload: shards and optimizer on the host, buffers on the GPU, DCP checkpoints "
          "(the optimizer runs on the CPU, so its steps synchronise)", "train",
          [*MODES, "--parallel.cpu_offload=true"], estimate=30, timeout=150, expect={"allow_syncs": True}),
    Stage("fp16", "fp16 with the device-side loss scaler", "train", [*MODES, "--training.precision=fp16"],
          estimate=25, timeout=150),
    Stage("bf16-pure", "bf16 parameters and optimizer state", "train", [*MODES, "--training.precision=bf16-pure"],
          estimate=25, timeout=150),
    Stage("float8-8b-width", "float8 training (torchao tensorwise, float8 FSDP all-gather, compiled blocks) on the "
          "Llama 3 8B width (4 layers) at seq 8192: tokens/s against bf16 on the same GPU in the same command "
          "(figures.speedup; torchtitan reports 1.25-1.5x on H100s)", "train",
          ["configs/llama3/8b-float8.toml", *FEW, jsonl_source("pydoc"), '--model.overrides={"n_layers": 4}',
           "--training.steps=6", "--logging.interval=6", "--training.global_batch_size=2",
           "--checkpoint.interval=0", "--checkpoint.save_final=false"],
          harness="benchmarks/float8_speedup.py", estimate=170, timeout=480, on_request=True),
    Stage("two-rank-fsdp", "NCCL between two GPUs: the demo on FSDP over 2 ranks", "torchrun",
          two_ranks(DEMO, "--parallel.dp_shard=2", "--training.micro_batch_size=8"), estimate=40, timeout=180, gpus=2),
    Stage("two-rank-tp", "tensor and sequence parallel with loss-parallel cross-entropy on NCCL", "torchrun",
          two_ranks(MODES, "--parallel.tp=2", "--parallel.dp_shard=1"), estimate=30, timeout=180, gpus=2),
    Stage("two-rank-cp", "context parallel: the K/V all-gather custom op on NCCL with FlexAttention", "torchrun",
          two_ranks(MODES, "--parallel.cp=2", "--parallel.dp_shard=1"), estimate=30, timeout=180, gpus=2),
    Stage("two-rank-pp", "pipeline parallel: 1F1B's point-to-point sends between GPUs", "torchrun",
          two_ranks(MODES, "--parallel.pp=2", "--parallel.dp_shard=1"), estimate=30, timeout=180, gpus=2),
    Stage("two-rank-ep", "expert parallel: the all-to-all token dispatch and grouped GEMM with a rank's share",
          "torchrun", two_ranks(MODES, "--model.name=olmoe", "--parallel.ep=2", "--parallel.dp_shard=2"),
          estimate=30, timeout=180, gpus=2),
]


# --- running the stages -----------------------------------------------------------------------------------------

def child_env(site: Path | None) -> dict[str, str]:
    """The stages' environment: this repository's src (maester need not be installed) and the installed wheels
    first on the path; no MAESTER_* config from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_")}
    paths = [str(REPO / "src")] + ([str(site)] if site else []) + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    return env


def cuda_test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "mark.cuda" in p.read_text())


def stage_args(stage: Stage, out: Path) -> list[str]:
    """The stage's config and overrides (for torchrun, after the process count), its job under out/jobs."""
    args = [a.replace("{data}", str(out / "data")) for a in stage.args]
    return args + [f"--job.dump_dir={out / 'jobs'}", f"--job.name={stage.name}"]


def command_of(stage: Stage, out: Path, dry_run: bool) -> list[str]:
    py = sys.executable
    if stage.kind == "pytest":  # its args: test files (default: every file with a cuda-marked test)
        return [py, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rs",
                f"--junitxml={out / (stage.name + '.xml')}", *(["--collect-only"] if dry_run else []),
                *(stage.args or cuda_test_files())]
    args = stage_args(stage, out)
    if stage.kind == "train":
        return [py, stage.harness, *args, *(["--allow-syncs"] if stage.expect.get("allow_syncs") else [])]
    return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args[0]}", "-m", "maester",
            "train", *args[1:]]


def dry_run_setups(stages: list[Stage], out: Path, env: dict) -> dict[str, dict]:
    """Every training stage's setup, up to its first use of a GPU, in one process: name -> result."""
    specs = [{"name": s.name, "args": stage_args(s, out)[1:] if s.kind == "torchrun" else stage_args(s, out),
              "world": int(s.args[0]) if s.kind == "torchrun" else 1} for s in stages if s.kind != "pytest"]
    if not specs:
        return {}
    listing = out / "dry-run-stages.json"
    listing.write_text(json.dumps(specs))
    start = time.monotonic()
    run = subprocess.run([sys.executable, HARNESS, "--dry-run-stages", str(listing)], cwd=REPO, env=env,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    seconds = round((time.monotonic() - start) / len(specs), 1)
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith(RESULT):
            verdict = json.loads(line[len(RESULT):])
            name = verdict.pop("stage")
            results[name] = {"status": "pass" if verdict.pop("ok") else "fail", "reason": verdict.pop("reason", ""),
                             "figures": verdict, "seconds": seconds}
    for spec in specs:
        results.setdefault(spec["name"], {"status": "fail", "reason": f"no result (exit {run.returncode}): "
                                                                      f"{last_error(run.stdout + run.stderr)}"})
    return results


def _interruptible() -> None:
    """In the stage's process before it starts: SIGINT at its default and unblocked. A process inherits both, and a
    check started in the background of a script (which ignores SIGINT) or from a process that blocks it would
    otherwise run each stage on to the SIGKILL, with no report of the tests it ran."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def run_command(command: list[str], env: dict, timeout: float) -> tuple[subprocess.CompletedProcess, bool]:
    """Run `command` in a session of its own; at `timeout`, SIGINT to its process group (pytest then writes the
    report of the tests it ran), and SIGKILL INTERRUPT_GRACE seconds later. Returns the run and whether it timed
    out."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_interruptible)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=INTERRUPT_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr), True


def run_stage(stage: Stage, out: Path, env: dict, timeout: float, dry_run: bool = False,
              wheels: Path = WHEELS) -> dict:
    command = command_of(stage, out, dry_run)
    result = {"name": stage.name, "proves": stage.proves, "command": " ".join(command),
              "estimate_seconds": stage.estimate}
    junit = out / f"{stage.name}.xml"
    junit.unlink(missing_ok=True)
    start = time.monotonic()
    run, timed_out = run_command(command, env, timeout)
    output = run.stdout + run.stderr
    result.update(seconds=round(time.monotonic() - start, 1), returncode=run.returncode, output_tail=output[-3000:])
    if stage.kind == "pytest":
        judged = judge_pytest(junit, run, dry_run)
        if timed_out:  # what ran before the time limit, from the report pytest writes on SIGINT
            ran = judged.get("figures", {}).get("tests", 0)
            judged.update(status="fail", reason=f"timed out after {timeout:.0f} s, {ran} test(s) run by then; "
                                                 f"{judged['reason'] or 'none of them failed'}")
        return {**result, **judged}
    if timed_out:
        return {**result, "status": "fail", "reason": f"timed out after {timeout:.0f} s"}
    if stage.kind == "torchrun":
        ok = run.returncode == 0
        return {**result, "status": "pass" if ok else "fail",
                "reason": "" if ok else f"exit code {run.returncode}: {last_error(output)}"}
    found = [line for line in run.stdout.splitlines() if line.startswith(RESULT)]
    if not found:
        return {**result, "status": "fail", "reason": f"exit code {run.returncode}, no result line: "
                                                      f"{last_error(output)}"}
    verdict = json.loads(found[-1][len(RESULT):])
    figures = verdict.get("figures", {})
    if stage.planned:  # the calibration of `maester plan` on this GPU
        figures.update(expected_peak(wheels, stage.name, stage.args))
        if "planned_peak_gib" in figures and "max_memory_allocated_gib" in figures:
            figures["peak_over_planned"] = round(figures["max_memory_allocated_gib"] / figures["planned_peak_gib"], 3)
    for snapshot in (out / "jobs" / stage.name).rglob("*.pickle"):  # our own run's memory snapshot, for memory_viz
        shutil.copy(snapshot, out / f"{stage.name}-memory-snapshot.pickle")
    status = "pass" if verdict["ok"] and run.returncode == 0 else "fail"
    return {**result, "status": status, "reason": verdict.get("reason", ""), "figures": figures}


def run_stages(stages: list[Stage], out: Path, env: dict, n_gpus: int, budget: float, report: dict,
               report_path: Path, dry_run: bool = False, wheels: Path = WHEELS) -> dict:
    """Run (or, dry, set up) the stages in order, writing the report before and after each, with each stage's
    measured seconds in `stage_seconds`; a stage that needs more GPUs than `n_gpus`, or more seconds than the
    budget has left, is not run and says why."""
    deadline = time.monotonic() + budget
    report.setdefault("stage_seconds", {})
    setups = dry_run_setups(stages, out, env) if dry_run else {}
    for stage in stages:
        left = deadline - time.monotonic()
        if stage.name in setups:
            result = {"name": stage.name, "proves": stage.proves, **setups[stage.name]}
        elif not dry_run and n_gpus < stage.gpus:
            result = {"name": stage.name, "status": "skip", "reason": f"needs {stage.gpus} GPUs, {n_gpus} here"}
        elif not dry_run and left < stage.estimate:
            result = {"name": stage.name, "status": "skip",
                      "reason": f"out of time budget ({left:.0f} s left, about {stage.estimate:.0f} s needed)"}
        else:
            report["stages"].append({"name": stage.name, "status": "running"})
            write_report(report_path, report)
            print(f"[{stage.name}] {'setting up' if dry_run else 'running'} ...", flush=True)
            result = run_stage(stage, out, env, 600 if dry_run else min(stage.timeout, left), dry_run, wheels)
            report["stages"].pop()
        if "seconds" in result:
            report["stage_seconds"][stage.name] = result["seconds"]
        report["stages"].append(result)
        report["verdict"] = verdict_of(report["stages"], dry_run)
        write_report(report_path, report)  # after every stage: a killed check still reports what it reached
        print(f"[{stage.name}] {result['status']} {result.get('seconds', '')} {result.get('reason', '')} "
              f"{json.dumps(result.get('figures', {}))}", flush=True)
    return report


def judge_pytest(junit: Path, run: subprocess.CompletedProcess, dry_run: bool) -> dict:
    """pass: every collected cuda test passed or was skipped for a reason the GPU itself gives (and at least one
    ran); fail: a failure, an error, nothing collected, or every test skipped."""
    if dry_run:
        collected = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", run.stdout)
        ok = run.returncode == 0 and collected is not None
        return {"status": "pass" if ok else "fail", "figures": {"collected": int(collected.group(1)) if collected
                                                                 else 0},
                "reason": "" if ok else f"collection failed (exit {run.returncode}): {last_error(run.stdout + run.stderr)}"}
    if not junit.is_file():
        return {"status": "fail", "reason": f"pytest wrote no report (exit {run.returncode}): "
                                            f"{last_error(run.stdout + run.stderr)}"}
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('classname')}.{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    skipped = sorted({(case.find("skipped").get("message") or "")[:120] for case in suite.iter("testcase")
                      if case.find("skipped") is not None})
    figures = {**counts, "failed": failed, "skip_reasons": skipped}
    if counts["failures"] or counts["errors"]:
        return {"status": "fail", "reason": f"{len(failed)} test(s) failed: {', '.join(failed[:8])}",
                "figures": figures}
    if counts["passed"] == 0:
        return {"status": "fail", "reason": "no cuda test ran (all skipped or none collected)", "figures": figures}
    return {"status": "pass", "reason": "", "figures": figures}


def last_error(output: str) -> str:
    """The line that says what went wrong: maester's own error line, else the last exception raised (not
    torchrun's summary of its failed child), else the last line of the output."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    ours = [line for line in lines if re.match(r"maester [\w -]+: error: ", line)]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception): \S", line)
              and "ChildFailedError" not in line]
    return (ours[:1] or raised[-1:] or lines[-1:] or ["(no output)"])[0][-400:]


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "hip": getattr(torch.version, "hip", None), "cuda_available": torch.cuda.is_available(),
           "gpus": [], "nccl": None, "driver": None}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                "arch": getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"})
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # reported, not fatal
            env["nccl"] = f"unknown ({e})"
    env["driver"] = _driver()
    return env


def _driver() -> str | None:
    for cmd in (["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                ["rocm-smi", "--showdriverversion"]):
        if shutil.which(cmd[0]):
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode == 0:
                return run.stdout.strip().splitlines()[0] if cmd[0] == "nvidia-smi" else run.stdout.strip()[-200:]
    return None


def torch_version_problem() -> str | None:
    try:
        import torch
    except ImportError as e:
        return f"{sys.executable} cannot import torch ({e}): run the check with a Python that has torch >= 2.10"
    found = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if found < TORCH_FLOOR:
        return f"torch {torch.__version__} in {sys.executable} is older than maester's floor, 2.10"
    return None


def verdict_of(stages: list[dict], dry_run: bool = False) -> str:
    failed = [s["name"] for s in stages if s["status"] == "fail"]
    not_run = [f"{s['name']} ({s['reason']})" for s in stages if s["status"] == "skip"]
    passed = [s["name"] for s in stages if s["status"] == "pass"]
    text = f"{len(passed)} {'set up (dry run: nothing ran on a GPU)' if dry_run else 'passed'}"
    if failed:
        text = f"FAIL: {', '.join(failed)}; " + text
    return text + (f"; not run: {'; '.join(not_run)}" if not_run else "")


def write_report(path: Path, report: dict) -> None:
    temp = path.with_suffix(".json.tmp")
    temp.write_text(json.dumps(report, indent=2))
    os.replace(temp, path)


def first_allocation_error(env: dict, code: str = FIRST_ALLOCATION) -> str | None:
    """None when `code` (a first allocation on the GPU) runs in a fresh Python under `env`; else its error."""
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=300)
    return None if run.returncode == 0 else last_error(run.stdout + run.stderr)


def allocator_env(env: dict, code: str = FIRST_ALLOCATION) -> tuple[dict, str]:
    """The stages' allocator setting: expandable segments (what maester and the harness set by default), unless
    the first allocation fails under them (they need CUDA's virtual memory API, which some sandboxed GPUs lack),
    then once more without; the caller's own PYTORCH_ALLOC_CONF is kept as it is. Returns the environment and what
    was chosen; SystemExit when the GPU cannot allocate either way."""
    if env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF"):
        return env, f"the caller's: {env.get('PYTORCH_ALLOC_CONF') or env.get('PYTORCH_CUDA_ALLOC_CONF')}"
    expandable = {**env, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    error = first_allocation_error(expandable, code)
    if error is None:
        return expandable, "expandable_segments:True"
    plain = {**env, "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    again = first_allocation_error(plain, code)
    if again is not None:
        raise SystemExit(f"gpu-check: the first allocation on the GPU fails with expandable segments ({error}) and "
                         f"without ({again}): nothing was checked")
    return plain, (f"expandable_segments:False: the first allocation failed under expandable_segments:True "
                   f"({error}); every stage runs without them")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "gpu-check",
                        help="the report, the jobs and their data (default: gpu-check/)")
    parser.add_argument("--wheels", type=Path, default=WHEELS,
                        help="the prepared wheels and the plan's peaks, whatever --out is (default: gpu-check/wheels; "
                             "what they lack is installed beside it, into site-cpXY)")
    parser.add_argument("--prepare", action="store_true", help="download the wheels the GPU image lacks and plan the "
                                                               "memory stages' peaks (needs the package index and the "
                                                               "project's environment, not a GPU)")
    parser.add_argument("--python-version", action="append",
                        help=f"--prepare: the GPU images' Pythons (default: {', '.join(PYTHON_VERSIONS)})")
    parser.add_argument("--platform", action="append",
                        help="--prepare: pip platform tags (default: manylinux x86_64)")
    parser.add_argument("--dry-run", action="store_true", help="each stage's setup up to its first use of a GPU")
    parser.add_argument("--stages", help=f"comma-separated stages to run (default all but those run on request, "
                                         f"{', '.join(s.name for s in STAGES if s.on_request)}: "
                                         f"{', '.join(s.name for s in STAGES if not s.on_request)})")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help=f"seconds for all stages; a stage starts only with its estimate left (default "
                             f"{DEFAULT_BUDGET}: with the setup, within one {DEVICE_CALL}-second device call)")
    args = parser.parse_args(argv)
    args.chosen = [s for s in STAGES if args.dry_run or not s.on_request]
    if args.stages:
        names = [n.strip() for n in args.stages.split(",") if n.strip()]
        unknown = [n for n in names if n not in {s.name for s in STAGES}]
        if unknown:
            parser.error(f"unknown stage(s) {', '.join(unknown)}: choose from {', '.join(s.name for s in STAGES)}")
        args.chosen = [s for s in STAGES if s.name in names]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, wheels = args.out.resolve(), args.wheels.resolve()
    if args.prepare:
        planned = [{"name": s.name, "args": s.args} for s in STAGES if s.planned]
        return prepare(wheels, args.python_version or PYTHON_VERSIONS, args.platform or PLATFORMS, planned)
    problem = torch_version_problem()
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        hip = getattr(torch.version, "hip", None)
        print(f"gpu-check needs a CUDA or ROCm GPU, and torch.cuda.is_available() is False here (torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}, HIP {hip}; CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Nothing was checked: the check never falls back to "
              f"the CPU. (--dry-run sets every stage up without a GPU.)", file=sys.stderr)
        return 2

    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    site, installed = install_wheels(wheels)
    env = child_env(site)
    allocator = "not probed (dry run)"
    if not args.dry_run:
        env, allocator = allocator_env(env)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": args.dry_run,
              "environment": environment(), "wheels": installed, "allocator": allocator,
              "budget_seconds": args.budget, "stages": []}
    report_path = out / ("gpu-check-dry-run.json" if args.dry_run else "gpu-check.json")
    print(json.dumps(report["environment"]), f"\nwheels: {installed}\nallocator: {allocator}", flush=True)
    data = subprocess.run([sys.executable, HARNESS, "--write-data", str(out / "data")], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if data.returncode:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        print(f"gpu-check: maester does not import with {sys.executable} ({last_error(data.stderr)}); wheels: "
              f"{installed}. Run `scripts/gpu-check.sh --prepare` (it prepares Python {', '.join(PYTHON_VERSIONS)}; "
              f"`--python-version {version}` for this one) where the package index is, and bring {wheels} along.",
              file=sys.stderr)
        return 1
    report["setup_seconds"] = round(time.monotonic() - start, 1)
    run_stages(args.chosen, out, env, n_gpus, args.budget, report, report_path, args.dry_run, wheels)
    report["total_seconds"] = round(time.monotonic() - start, 1)
    write_report(report_path, report)
    print(f"verdict: {report['verdict']}\nseconds: {report['total_seconds']} (setup {report['setup_seconds']}, "
          f"stages {json.dumps(report['stage_seconds'])})\nreport: {report_path}")
    return 1 if any(s["status"] == "fail" for s in report["stages"]) else 0


if __name__ == "__main__":
    sys.exit(main())
