"""GPU check: one command that gives a verdict on a GPU machine, also a bare one (its own python3 and torch, no uv,
no network), within a time budget. Run it through `scripts/gpu-check.sh`; docs/gpu-first-run.md says what to run
first and how to read the report.

    scripts/gpu-check.sh --prepare [--python-version 3.12]   # where the package index is: wheels for the GPU image
    scripts/gpu-check.sh [--out DIR] [--stages a,b] [--budget SECONDS]
    scripts/gpu-check.sh --dry-run                           # every stage's setup up to its first use of a GPU

Stages run in the order of STAGES, the most informative first; each writes its result into DIR/gpu-check.json as
soon as it ends (a check killed at its time limit still reports what it reached). A stage passes, fails with its
reason, or is not run ("skip": needs more GPUs, or the budget is spent); only a pass counts as one. Without a
usable GPU the check refuses (exit 2) rather than check the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = "benchmarks/gpu_check_train.py"
RESULT = "GPU_CHECK_RESULT"
TORCH_FLOOR = (2, 10)
WHEELS_LIMIT_MB = 60

# What the check's code paths import beyond torch and torch's own requirements (pyproject's bounds), and pytest for
# the CUDA tests; their own requirements come with them. pyarrow (55 MB) is left out: the stages read JSONL.
# torchao (3 MB) serves the float8 stage.
CHECK_REQUIREMENTS = ["pydantic>=2.7,<3", "numpy>=1.26", "zstandard>=0.22", "pyyaml>=6", "tqdm>=4.66", "pytest>=8",
                      "torchao>=0.16"]


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
          estimate=148, timeout=360, expect={"predicted_peak_gib": [35, 42],
                                             "predicted_by": "second GPU review, section 4 run 2"}),
    Stage("llama3-8b-width", "Llama 3 8B width (4 layers) at seq 8192: cuDNN/flash SDPA inside compiled selective AC; "
          "tokens/s and MFU at the real width", "train",
          ["configs/llama3/8b.toml", *FEW, jsonl_source("pydoc"), '--model.overrides={"n_layers": 4}',
           "--training.steps=6", "--logging.interval=6", "--training.global_batch_size=2",
           "--checkpoint.interval=0", "--checkpoint.save_final=false"],
          estimate=84, timeout=300, expect={"predicted_peak_gib": [38, 42],
                                            "predicted_by": "second GPU review, section 4 run 3"}),
    Stage("olmoe-width", "OLMoE 1B-7B width (2 layers): the experts under FSDP mixed precision, full AC, z-loss; "
          "torch._grouped_mm forward and backward where the GPU has its grouped kernel (H100, B200), else the "
          "experts' loop with its one host read per MoE layer and forward, allowed and said in the figures",
          "train", ["configs/olmoe/1b-7b.toml", *FEW, jsonl_source("pydoc"), "--parallel.ep=1",
                    '--model.overrides={"n_layers": 2, "moe": {"z_loss_coef": 0.001}}', "--training.steps=6",
                    "--logging.interval=6", "--training.global_batch_size=8", "--checkpoint.interval=0",
                    "--checkpoint.save_final=false"],
          estimate=54, timeout=240, expect={"predicted_peak_gib": [25, 30],
                                           "predicted_by": "second GPU review, section 4 run 4"}),
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
    Stage("cuda-tests", "every test marked cuda (kernels, routing, grouped GEMM, profiler, precision) passes",
          "pytest", estimate=80, timeout=360),
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


# --- preparing and installing the wheels ------------------------------------------------------------------------

def wheel_dir(out: Path, python_version: str) -> Path:
    return out / "wheels" / f"cp{python_version.replace('.', '')}"


def prepare(out: Path, python_version: str, platforms: list[str]) -> int:
    """Download the wheels the check needs beyond torch for `python_version` on `platforms` (a stock PyTorch image
    has torch and its own requirements); refuse a folder over WHEELS_LIMIT_MB."""
    target = wheel_dir(out, python_version)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
               "--python-version", python_version, "--dest", str(target),
               *[a for p in platforms for a in ("--platform", p)], *CHECK_REQUIREMENTS]
    print("$", " ".join(command), flush=True)
    run = subprocess.run(command)
    if run.returncode:
        print(f"gpu-check --prepare: pip download failed (exit {run.returncode}); it needs the package index",
              file=sys.stderr)
        return 1
    wheels = sorted(target.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    (target / "manifest.json").write_text(json.dumps(
        {"python_version": python_version, "platforms": platforms, "requirements": CHECK_REQUIREMENTS,
         "wheels": {w.name: w.stat().st_size for w in wheels}, "megabytes": round(size, 1)}, indent=2))
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.1f} MB  {w.name}")
    print(f"{len(wheels)} wheels, {size:.1f} MB in {target}")
    if size > WHEELS_LIMIT_MB:
        print(f"gpu-check --prepare: {size:.1f} MB is over the {WHEELS_LIMIT_MB} MB limit", file=sys.stderr)
        return 1
    return 0


def missing_wheels(wheels: list[Path]) -> list[Path]:
    """The wheels whose distribution is not installed, or installed at a version that some prepared wheel's
    requirements (or the check's own) refuse."""
    from importlib import metadata
    from zipfile import ZipFile

    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

    specifiers: dict[str, list] = {}
    for line in CHECK_REQUIREMENTS:
        req = Requirement(line)
        specifiers.setdefault(canonicalize_name(req.name), []).append(req.specifier)
    for wheel in wheels:
        with ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist:"):
                    req = Requirement(line.split(":", 1)[1].strip())
                    if req.marker is None or req.marker.evaluate({"extra": ""}):
                        specifiers.setdefault(canonicalize_name(req.name), []).append(req.specifier)
    missing = []
    for wheel in wheels:
        name = canonicalize_name(wheel.name.split("-")[0])
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            missing.append(wheel)
            continue
        if not all(spec.contains(installed, prereleases=True) for spec in specifiers.get(name, [])):
            missing.append(wheel)
    return missing


def install_wheels(out: Path) -> tuple[Path | None, str]:
    """Install the prepared wheels this Python lacks into out/site-cpXY, offline; returns (site, what happened)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    folder = wheel_dir(out, version)
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return None, f"no prepared wheels in {folder}"
    site = out / f"site-cp{version.replace('.', '')}"
    needed = missing_wheels(wheels)
    stamp = site / "installed.json"
    names = [w.name for w in needed]
    if not needed:
        return None, "every prepared distribution is installed already"
    if stamp.is_file() and json.loads(stamp.read_text()) == names:
        return site, f"installed earlier: {', '.join(names)}"
    if site.exists():
        shutil.rmtree(site)
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                          "--no-compile", "--disable-pip-version-check", "--target", str(site), *map(str, needed)],
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"gpu-check: installing the prepared wheels failed:\n{run.stdout}{run.stderr}")
    stamp.write_text(json.dumps(names))
    return site, f"installed offline: {', '.join(names)}"


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
        return [py, stage.harness, *args, *(["--allow-syncs"] if stage.expect.get("allow_syncs") else []),
                *(["--plan"] if "predicted_peak_gib" in stage.expect else [])]  # maester plan's peak beside it
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


def run_stage(stage: Stage, out: Path, env: dict, timeout: float, dry_run: bool = False) -> dict:
    command = command_of(stage, out, dry_run)
    result = {"name": stage.name, "proves": stage.proves, "command": " ".join(command)}
    start = time.monotonic()
    try:
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"))[-3000:]
        return {**result, "status": "fail", "reason": f"timed out after {timeout:.0f} s",
                "seconds": round(time.monotonic() - start, 1), "output_tail": tail}
    output = run.stdout + run.stderr
    result.update(seconds=round(time.monotonic() - start, 1), returncode=run.returncode, output_tail=output[-3000:])
    if stage.kind == "pytest":
        return {**result, **judge_pytest(out / f"{stage.name}.xml", run, dry_run)}
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
    expect = {k: v for k, v in stage.expect.items() if k.startswith("predicted")}
    if expect and "max_memory_allocated_gib" in figures:
        low, high = expect["predicted_peak_gib"]
        figures["peak_over_predicted"] = round(figures["max_memory_allocated_gib"] / ((low + high) / 2), 3)
    for snapshot in (out / "jobs" / stage.name).rglob("*.pickle"):  # our own run's memory snapshot, for memory_viz
        shutil.copy(snapshot, out / f"{stage.name}-memory-snapshot.pickle")
    status = "pass" if verdict["ok"] and run.returncode == 0 else "fail"
    return {**result, "status": status, "reason": verdict.get("reason", ""), "figures": figures, **expect}


def run_stages(stages: list[Stage], out: Path, env: dict, n_gpus: int, budget: float, report: dict,
               report_path: Path, dry_run: bool = False) -> dict:
    """Run (or, dry, set up) the stages in order, writing the report before and after each; a stage that needs
    more GPUs than `n_gpus`, or more seconds than the budget has left, is not run and says why."""
    deadline = time.monotonic() + budget
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
            result = run_stage(stage, out, env, 600 if dry_run else min(stage.timeout, left), dry_run)
            report["stages"].pop()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "gpu-check",
                        help="the report, the jobs, the prepared wheels (default: gpu-check/)")
    parser.add_argument("--prepare", action="store_true", help="download the wheels the GPU image lacks (needs the "
                                                               "package index, not a GPU)")
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="--prepare: the GPU image's Python (default: this one's)")
    parser.add_argument("--platform", action="append",
                        help="--prepare: pip platform tags (default: manylinux x86_64)")
    parser.add_argument("--dry-run", action="store_true", help="each stage's setup up to its first use of a GPU")
    parser.add_argument("--stages", help=f"comma-separated stages to run (default all but those run on request, "
                                         f"{', '.join(s.name for s in STAGES if s.on_request)}: "
                                         f"{', '.join(s.name for s in STAGES if not s.on_request)})")
    parser.add_argument("--budget", type=float, default=450,
                        help="seconds for all stages; a stage starts only with its estimate left (default 450)")
    args = parser.parse_args(argv)
    out = args.out.resolve()

    if args.prepare:
        return prepare(out, args.python_version, args.platform or [
            "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"])
    chosen = [s for s in STAGES if args.dry_run or not s.on_request]
    if args.stages:
        names = [n.strip() for n in args.stages.split(",") if n.strip()]
        unknown = [n for n in names if n not in {s.name for s in STAGES}]
        if unknown:
            parser.error(f"unknown stage(s) {', '.join(unknown)}: choose from {', '.join(s.name for s in STAGES)}")
        chosen = [s for s in STAGES if s.name in names]
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

    out.mkdir(parents=True, exist_ok=True)
    site, installed = install_wheels(out)
    env = child_env(site)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": args.dry_run,
              "environment": environment(), "wheels": installed, "budget_seconds": args.budget, "stages": []}
    report_path = out / ("gpu-check-dry-run.json" if args.dry_run else "gpu-check.json")
    print(json.dumps(report["environment"]), f"\nwheels: {installed}", flush=True)
    data = subprocess.run([sys.executable, HARNESS, "--write-data", str(out / "data")], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if data.returncode:
        print(f"gpu-check: maester does not import with {sys.executable} ({last_error(data.stderr)}); wheels: "
              f"{installed}. Run `scripts/gpu-check.sh --prepare --python-version {sys.version_info.major}."
              f"{sys.version_info.minor}` where the package index is, and bring {out / 'wheels'} along.",
              file=sys.stderr)
        return 1
    run_stages(chosen, out, env, n_gpus, args.budget, report, report_path, args.dry_run)
    print(f"verdict: {report['verdict']}\nreport: {report_path}")
    return 1 if any(s["status"] == "fail" for s in report["stages"]) else 0


if __name__ == "__main__":
    sys.exit(main())
