"""The GPU check: refused without a GPU; set up on a bare Python that has only torch and the prepared wheels, with
no package index; every kind of stage can fail and says why; stages it cannot run are never counted as passed; the
report is written after every stage."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
TORCH_ENV = REPO / ".venv-torch210"  # .ci/run makes it: PyPI's torch 2.10.0, the floor
PREPARED = REPO / "gpu-check" / "wheels"  # .ci/run prepares it: cp311 and cp312, and the plan's peaks
WHEELS = PREPARED / f"cp{sys.version_info.major}{sys.version_info.minor}"
REQUIRED = os.environ.get("_MAESTER_REQUIRE_GPU_CHECK_ENV") == "1"  # CI: fail, not skip, when either is missing


def benchmark(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    from tests.helpers import clean_env

    return subprocess.run(args, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_the_check_refuses_and_writes_nothing(tmp_path):
    out = tmp_path / "report"
    result = run(["bash", "scripts/gpu-check.sh", "--out", str(out)], PYTHON=sys.executable)
    assert result.returncode == 2, result.stderr
    assert "gpu-check needs a CUDA or ROCm GPU" in result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr
    assert not out.exists()
    assert (REPO / "scripts" / "gpu-check.sh").stat().st_mode & 0o111


def bare_python(root: Path) -> Path:
    """A virtual environment whose only packages beyond pip are torch, what torch itself requires and numpy, linked
    from the torch-2.10 environment: what a stock PyTorch image has at the least."""
    source = TORCH_ENV / "bin" / "python"
    listing = subprocess.run([str(source), "-c", """
import json, re
from importlib import metadata
seen, todo, tops = set(), ["torch", "numpy"], set()
while todo:
    name = todo.pop()
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    tops |= {str(dist.locate_file(f.parts[0])) for f in dist.files or [] if not f.parts[0].startswith("..")}
    todo += [re.split(r"[ ;<>=!~\\[(]", r)[0].lower() for r in dist.requires or [] if "extra ==" not in r]
print(json.dumps(sorted(tops)))
"""], capture_output=True, text=True, check=True)
    site = root / "torch-only"
    site.mkdir(parents=True)
    for top in json.loads(listing.stdout):
        if Path(top).exists() and not (site / Path(top).name).exists():
            (site / Path(top).name).symlink_to(top)
    home = next(line.split("=", 1)[1].strip() for line in (TORCH_ENV / "pyvenv.cfg").read_text().splitlines()
                if line.startswith("home"))
    venv = root / "venv"
    subprocess.run([str(Path(home) / "python3"), "-m", "venv", str(venv)], check=True, capture_output=True)
    packages = next((venv / "lib").glob("python3*/site-packages"))
    (packages / "torch-only.pth").write_text(f"{site}\n")
    return venv / "bin" / "python"


@pytest.mark.slow
def test_dry_run_on_a_bare_python_with_the_prepared_wheels_and_no_package_index(tmp_path):
    missing = [str(p) for p in (TORCH_ENV / "bin" / "python", WHEELS / "manifest.json") if not p.exists()]
    if missing:
        message = (f"needs {', '.join(missing)}: .ci/run makes the torch-2.10 environment and runs "
                   f"`scripts/gpu-check.sh --prepare`")
        pytest.fail(message) if REQUIRED else pytest.skip(message)
    manifests = [json.loads((PREPARED / f"cp{v}" / "manifest.json").read_text()) for v in ("311", "312")]
    assert sum(sum(m["wheels"].values()) for m in manifests) / 2**20 < 60  # both sets: what a device call carries
    assert not any(w.startswith("numpy-") for m in manifests for w in m["wheels"])  # every torch image has it
    peaks = json.loads((PREPARED / "expected-peaks.json").read_text())["stages"]
    planned = {"gemma3-1b-sft": 33.5, "llama3-8b-width": 37.5, "olmoe-width": 23.3}  # the third GPU review's A8
    assert {name: round(peaks[name]["planned_peak_gib"], 1) for name in peaks} == planned, peaks
    python = bare_python(tmp_path / "bare")
    no_index = dict(PYTHON=str(python), PIP_NO_INDEX="1", PIP_INDEX_URL="http://127.0.0.1:9/simple",
                    PYTHONPATH="", HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    probe = run([str(python), "-c", "import torch; print(torch.__version__)\ntry:\n import pydantic\nexcept "
                 "ImportError:\n print('no pydantic')"], **no_index)
    assert probe.stdout.split()[0].startswith(("2.10.", "2.11.")) and "no pydantic" in probe.stdout, probe

    without = run(["bash", "scripts/gpu-check.sh", "--dry-run", "--out", str(tmp_path / "no-wheels"), "--wheels",
                   str(tmp_path / "no-wheels" / "wheels")], **no_index)
    assert without.returncode == 1 and "No module named 'pydantic'" in without.stderr
    assert "scripts/gpu-check.sh --prepare" in without.stderr and "--python-version 3.11" in without.stderr, \
        without.stderr[-2000:]

    out, wheels = tmp_path / "out", tmp_path / "carried" / "wheels"  # the wheels stay where they were brought
    shutil.copytree(WHEELS, wheels / WHEELS.name)
    result = run(["bash", "scripts/gpu-check.sh", "--dry-run", "--out", str(out), "--wheels", str(wheels)],
                 timeout=900, **no_index)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu-check-dry-run.json").read_text())
    gpu_check = benchmark("gpu_check")
    assert [s["name"] for s in report["stages"]] == [s.name for s in gpu_check.STAGES]
    assert all(s["status"] == "pass" for s in report["stages"]), report["stages"]
    assert report["environment"]["torch"].startswith(("2.10.", "2.11.")) and not report["environment"]["cuda_available"]
    installed = json.loads((wheels.parent / f"site-{WHEELS.name}" / "installed.json").read_text())
    assert any(w.startswith("pydantic-") for w in installed) and any(w.startswith("zstandard-") for w in installed)
    by_name = {s["name"]: s for s in report["stages"]}
    assert by_name["cuda-tests"]["figures"]["collected"] >= 10
    assert by_name["gemma3-1b-sft"]["figures"]["parameters"] > 0.99e9  # the shipped model, not a tiny one


@pytest.fixture
def harness():
    module = benchmark("gpu_check_train")
    yield module
    if dist.is_initialized():
        dist.destroy_process_group()


def tiny_stage(tmp_path, name: str, *extra: str) -> list[str]:
    from tests.helpers import tiny_overrides, write_corpus

    corpus = write_corpus(tmp_path / "corpus.parquet")
    return [*tiny_overrides(corpus, tmp_path / "jobs", name, training__steps=4, logging__interval=4,
                            checkpoint__interval=0, parallel__force_fsdp="true"), *extra]


def test_the_sync_stage_passes_a_clean_step_and_fails_a_host_read_between_logging_steps(tmp_path, harness):
    """A mixture of experts without the grouped-GEMM fast path (the CPU here; A100, MI250X on GPUs) passes: the
    experts' loop reads its group sizes on the host once per MoE layer and forward, by design, and the figures say
    so; any other read between logging steps fails the stage."""
    from maester.config import load_config

    moe = tiny_stage(tmp_path, "clean", "--model.name=olmoe", "--training.steps=3", "--logging.interval=3",
                     "--training.global_batch_size=2")
    clean = harness.train(load_config(None, moe, environ={}), inject=False, allow_syncs=False, torch=torch)
    assert clean["ok"], clean["reason"]
    figures = clean["figures"]
    assert figures["model_type"] == "FSDPTransformer" and figures["parameter_type"] == "DTensor"
    assert figures["syncs_per_step"] == 0 and int(figures["syncs_by_step"]["3"]) > 0  # it counts, on step 3
    # 2 MoE layers x 1 micro-batch, no recomputation: 2 reads on step 2, the one between the logging steps
    assert figures["expert_loop_reads_by_step"] == {"2": 2}, figures
    assert "no grouped-GEMM fast path on cpu" in figures["expert_loop"]
    injected = harness.train(load_config(None, tiny_stage(tmp_path, "injected"), environ={}), inject=True,
                             allow_syncs=False, torch=torch)
    assert not injected["ok"]
    assert "synchronisations on steps that do not log or save: {2: 1, 3: 1}" in injected["reason"]
    assert "train/trainer.py" in injected["reason"]  # where the read happened
    assert injected["figures"]["syncs_per_step"] == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_moe_stage_passes_on_this_gpu_with_or_without_the_grouped_gemm_fast_path(tmp_path, harness):
    """On a GPU with `torch._grouped_mm`'s grouped kernel no read is allowed; elsewhere the experts' loop reads its
    group sizes once per MoE layer and forward, allowed and said in the figures."""
    from maester.config import load_config
    from maester.models.moe import _fast_path_on
    from tests.helpers import tiny_overrides

    args = tiny_overrides("builtin:pydoc", tmp_path / "jobs", "moe", training__steps=4, logging__interval=4,
                          checkpoint__interval=0, parallel__force_fsdp="true", model__name="olmoe",
                          training__device="cuda")  # no Parquet: GPU images may lack pyarrow
    cfg = load_config(None, args, environ={})
    result = harness.train(cfg, inject=False, allow_syncs=False, torch=torch)
    assert result["ok"], result["reason"]
    assert ("expert_loop" in result["figures"]) != _fast_path_on(torch.device("cuda", 0)), result["figures"]


def test_a_training_stage_whose_config_is_refused_fails_and_names_the_key(tmp_path):
    gpu_check = benchmark("gpu_check")
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    stage = gpu_check.Stage("broken", "nothing", "train", ["configs/demo.toml", "--training.no_such_key=1"])
    good = gpu_check.Stage("good", "the demo config", "train", ["configs/demo.toml", "--training.steps=30"])
    results = gpu_check.dry_run_setups([stage, good], out, gpu_check.child_env(None))
    assert results["broken"]["status"] == "fail" and "no_such_key" in results["broken"]["reason"]
    assert results["good"]["status"] == "pass", results["good"]  # the next stage still sets up


def test_a_multi_gpu_stage_fails_with_the_error_of_its_ranks(tmp_path):
    gpu_check = benchmark("gpu_check")
    stage = gpu_check.Stage("refused-layout", "", "torchrun", ["1", "configs/demo.toml", "--training.device=cpu",
                                                               "--parallel.tp=2"])
    result = gpu_check.run_stage(stage, tmp_path, gpu_check.child_env(None), timeout=600)
    assert result["status"] == "fail" and result["reason"].startswith("exit code 1"), result
    assert "parallel layout" in result["reason"] and "does not divide the 1 process(es)" in result["reason"]


CUDA_TEST = '''
import pytest
from maester.config import load_config
from maester.parallel.dims import ParallelDims

@pytest.mark.cuda
def test_one_gpu_offload_layout():
    cfg = load_config(None, ["--training.device=cuda", "--parallel.cpu_offload=true"{extra}], environ={{}})
    ParallelDims.from_config(cfg, 1)
'''


def test_the_cuda_tests_stage_fails_on_a_refused_config_and_on_no_test_run(tmp_path):
    gpu_check = benchmark("gpu_check")
    env = gpu_check.child_env(None)
    (tmp_path / "test_accepted.py").write_text(CUDA_TEST.format(extra=', "--parallel.force_fsdp=true"'))
    (tmp_path / "test_refused.py").write_text(CUDA_TEST.format(extra=""))
    (tmp_path / "skips" / "test_skipped.py").parent.mkdir()
    (tmp_path / "skips" / "test_skipped.py").write_text(
        "import pytest\n@pytest.mark.cuda\n@pytest.mark.skip(reason='needs 2 GPUs')\ndef test_two():\n    pass\n")
    both = gpu_check.run_stage(gpu_check.Stage("cuda-both", "", "pytest", [str(tmp_path / "test_accepted.py"),
                                                                           str(tmp_path / "test_refused.py")]),
                               tmp_path, env, timeout=300)
    assert both["status"] == "fail" and both["figures"]["passed"] == 1 and both["figures"]["failures"] == 1
    assert "test_refused.test_one_gpu_offload_layout" in both["reason"], both["reason"]
    assert "applies to FSDP only" in both["output_tail"]
    skipped = gpu_check.run_stage(gpu_check.Stage("cuda-skipped", "", "pytest", [str(tmp_path / "skips")]),
                                  tmp_path, env, timeout=300)
    assert skipped["status"] == "fail" and "no cuda test ran" in skipped["reason"]
    assert skipped["figures"]["skip_reasons"] == ["needs 2 GPUs"]


def test_stages_that_need_more_gpus_or_time_are_not_run_and_not_passed_and_the_report_follows_each_stage(
        tmp_path):
    gpu_check = benchmark("gpu_check")
    first = tmp_path / "test_first.py"
    first.write_text("import pytest\n@pytest.mark.cuda\ndef test_first():\n    pass\n")
    second = tmp_path / "test_second.py"  # runs after the first: the report on disk already holds its result
    second.write_text(f"import json, pytest\n@pytest.mark.cuda\ndef test_second():\n"
                      f"    stages = json.load(open({str(tmp_path / 'report.json')!r}))['stages']\n"
                      f"    assert [(s['name'], s['status']) for s in stages] == "
                      f"[('first', 'pass'), ('second', 'running')]\n")
    stages = [gpu_check.Stage("first", "", "pytest", [str(first)], estimate=1),
              gpu_check.Stage("second", "", "pytest", [str(second)], estimate=1),
              gpu_check.Stage("two-rank", "", "torchrun", ["2", "configs/demo.toml"], gpus=2),
              gpu_check.Stage("long", "", "pytest", [str(first)], estimate=10_000)]
    report = gpu_check.run_stages(stages, tmp_path, gpu_check.child_env(None), n_gpus=1, budget=600,
                                  report={"stages": []}, report_path=tmp_path / "report.json")
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    status = {s["name"]: (s["status"], s.get("reason")) for s in on_disk["stages"]}
    assert status["first"] == ("pass", "") and status["second"] == ("pass", ""), on_disk["stages"]
    assert status["two-rank"] == ("skip", "needs 2 GPUs, 1 here")
    assert status["long"][0] == "skip" and status["long"][1].startswith("out of time budget")
    assert on_disk["verdict"].startswith("2 passed; not run: two-rank (needs 2 GPUs, 1 here); long (out of time")


def test_every_stage_has_a_unique_name_and_the_stage_option_refuses_unknown_ones():
    gpu_check = benchmark("gpu_check")
    names = [s.name for s in gpu_check.STAGES]
    assert len(set(names)) == len(names)
    assert names[0] == "fsdp-sync"  # the quickest verdict on the multi-GPU code path comes first
    default = [s for s in gpu_check.STAGES if s.gpus == 1 and not s.on_request]
    # Every default stage starts within the default budget (the CUDA tests too), and the whole check, with its setup
    # and a margin, fits one device call of 10 minutes.
    assert sum(s.estimate for s in default) <= gpu_check.DEFAULT_BUDGET
    assert gpu_check.DEFAULT_BUDGET + gpu_check.SETUP_SECONDS + gpu_check.INTERRUPT_GRACE <= 600 - 30
    assert gpu_check.parse_args([]).budget == gpu_check.DEFAULT_BUDGET
    with pytest.raises(SystemExit):
        gpu_check.main(["--stages", "fsdp-sync,no-such-stage", "--dry-run"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_environment_names_the_gpus_and_collective_library():
    env = benchmark("gpu_check").environment()
    assert len(env["gpus"]) == torch.cuda.device_count() >= 1
    assert all(g["name"] or g["arch"] for g in env["gpus"])
    assert env["nccl"] and not env["nccl"].startswith("unknown")
    json.dumps(env)


def test_the_memory_stages_take_the_peak_planned_at_prepare(tmp_path):
    """--prepare plans the memory stages with the project's torch (the GPU image's may be too old to plan) into
    expected-peaks.json beside the wheels, each with the arguments it was planned for: a stage takes its figure
    from there, and a stage whose arguments changed since is told to prepare again."""
    gpu_check = benchmark("gpu_check")
    wheels = benchmark("gpu_check_wheels")
    assert [s.name for s in gpu_check.STAGES if s.planned] == ["gemma3-1b-sft", "llama3-8b-width", "olmoe-width"]
    args = ["configs/demo.toml", *gpu_check.FEW, gpu_check.jsonl_source("pydoc"), "--model.flavor=tiny"]
    assert wheels.plan_peaks(tmp_path, [{"name": "tiny", "args": args}], Path(sys.executable)) == 0
    peak = wheels.expected_peak(tmp_path, "tiny", args)
    assert 0 < peak["planned_peak_gib"] < 1, peak
    assert "prepared for other arguments of tiny" in wheels.expected_peak(tmp_path, "tiny", args + ["--x=1"])[
        "plan_not_made"]
    assert "no " in wheels.expected_peak(tmp_path / "elsewhere", "tiny", args)["plan_not_made"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_planned_stage_on_this_gpu_sets_its_measured_peak_over_the_prepared_one(tmp_path):
    gpu_check = benchmark("gpu_check")
    args = ["configs/demo.toml", *gpu_check.FEW, gpu_check.jsonl_source("pydoc"), "--model.flavor=tiny",
            "--training.steps=2", "--logging.interval=2", "--checkpoint.interval=0", "--checkpoint.save_final=false"]
    stage = gpu_check.Stage("tiny-planned", "", "train", args, planned=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()  # as --prepare writes it, with a round figure: the GPU image's torch may be too old to plan
    (wheels / "expected-peaks.json").write_text(json.dumps(
        {"torch": "2.15", "stages": {stage.name: {"args": args, "planned_peak_gib": 0.5}}}))
    subprocess.run([sys.executable, gpu_check.HARNESS, "--write-data", str(tmp_path / "data")], cwd=REPO, check=True,
                   env=gpu_check.child_env(None))
    result = gpu_check.run_stage(stage, tmp_path, gpu_check.child_env(None), timeout=300, wheels=wheels)
    assert result["status"] == "pass", result
    figures = result["figures"]
    assert figures["peak_over_planned"] == round(figures["max_memory_allocated_gib"] / 0.5, 3), figures


def test_prepare_fetches_both_pythons_into_the_fixed_folder_and_says_when_pip_is_missing(tmp_path):
    gpu_check = benchmark("gpu_check")
    wheels = benchmark("gpu_check_wheels")
    args = gpu_check.parse_args(["--prepare", "--out", str(tmp_path / "elsewhere")])
    assert args.python_version is None and wheels.PYTHON_VERSIONS == ["3.11", "3.12"]
    assert args.wheels == REPO / "gpu-check" / "wheels"  # whatever --out says
    assert not any(r.startswith("numpy") for r in wheels.CHECK_REQUIREMENTS)
    venv = REPO / ".venv" / "bin" / "python"  # uv makes environments without pip
    if subprocess.run([str(venv), "-c", "import pip"], capture_output=True).returncode == 0:
        pytest.skip(f"{venv} has pip")
    result = run([str(venv), "benchmarks/gpu_check.py", "--prepare", "--wheels", str(tmp_path / "wheels")])
    assert result.returncode == 1 and "has no pip (a uv environment has none)" in result.stderr, result.stderr
    assert "PYTHON=python3 scripts/gpu-check.sh --prepare" in result.stderr
    assert not (tmp_path / "wheels").exists()


FAILS_UNDER_EXPANDABLE = ("import os, sys; sys.exit('RuntimeError: CUDA error: operation not supported') "
                          "if os.environ['PYTORCH_ALLOC_CONF'] == 'expandable_segments:True' else None")


def test_a_first_allocation_that_fails_under_expandable_segments_is_retried_once_without():
    """Expandable segments need CUDA's virtual memory API, which sandboxed GPUs may lack: the check probes the
    first allocation under them, then without, and runs every stage with what worked (here a stand-in for the
    allocation that fails the same way, as no GPU is here)."""
    gpu_check = benchmark("gpu_check")
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    chosen, said = gpu_check.allocator_env(env, FAILS_UNDER_EXPANDABLE)
    assert chosen["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    assert said.startswith("expandable_segments:False: the first allocation failed under expandable_segments:True")
    assert "operation not supported" in said
    fine, said = gpu_check.allocator_env(env, "pass")
    assert fine["PYTORCH_ALLOC_CONF"] == "expandable_segments:True" and said == "expandable_segments:True"
    with pytest.raises(SystemExit, match="fails with expandable segments .* and without"):
        gpu_check.allocator_env(env, "raise RuntimeError('no device')")
    own, said = gpu_check.allocator_env({**env, "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8"}, "pass")
    assert own["PYTORCH_ALLOC_CONF"] == "garbage_collection_threshold:0.8" and "the caller's" in said


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_first_allocation_probe_allocates_on_this_gpu():
    gpu_check = benchmark("gpu_check")
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    assert gpu_check.first_allocation_error({**env, "PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is None
    chosen, said = gpu_check.allocator_env(env)
    assert chosen["PYTORCH_ALLOC_CONF"].startswith("expandable_segments:"), said


@pytest.mark.parametrize("parent", ["ignores SIGINT", "blocks SIGINT"])
def test_a_pytest_stage_stopped_at_its_time_limit_reports_the_tests_it_ran(tmp_path, parent):
    """At its time limit a stage gets SIGINT first: pytest then writes the report of what ran, so a cuda-tests
    stage cut short still names its passes and failures; also when the check itself ignores SIGINT (started in the
    background of a script) or blocks it, which its processes would inherit."""
    gpu_check = benchmark("gpu_check")
    tests = tmp_path / "test_long.py"
    tests.write_text("import time, pytest\n@pytest.mark.cuda\ndef test_quick():\n    pass\n"
                     "@pytest.mark.cuda\ndef test_forever():\n    time.sleep(600)\n")
    handler, mask = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        if parent == "ignores SIGINT":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        elif parent == "blocks SIGINT":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        result = gpu_check.run_stage(gpu_check.Stage("cut", "", "pytest", [str(tests)]), tmp_path,
                                     gpu_check.child_env(None), timeout=20)
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert result["status"] == "fail" and result["reason"].startswith("timed out after 20 s"), result
    assert result["figures"]["passed"] >= 1 and result["seconds"] < 20 + gpu_check.INTERRUPT_GRACE + 5, result
