"""The GPU check's preparation, where the package index is (`scripts/gpu-check.sh --prepare`), and its use on the GPU
machine: the wheels a stock PyTorch image lacks, for each Python the images run (cp311 and cp312), and the memory
peaks `maester plan` predicts for the check's memory stages, made with the project's torch (2.15: older torch cannot
plan), so that a GPU image with an older torch still compares its measured peaks with the plan. All of it goes into
one folder, gpu-check/wheels/ by default (whatever the check's --out), to bring along to the GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "gpu-check" / "wheels"
PEAKS_FILE = "expected-peaks.json"
PEAKS = "GPU_CHECK_PEAKS "
PYTHON_VERSIONS = ["3.11", "3.12"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
WHEELS_LIMIT_MB = 60
"""For all Python versions together: the device machine's tool carries at most 64 MiB."""

# What the check's code paths import beyond torch and torch's own requirements (pyproject's bounds), and pytest for
# the CUDA tests; their own requirements come with them. Left out: numpy, which every PyTorch image has, and
# pyarrow (55 MB): the stages read JSONL. torchao (3 MB) serves the float8 stage.
CHECK_REQUIREMENTS = ["pydantic>=2.7,<3", "zstandard>=0.22", "xxhash>=3", "pyyaml>=6", "tqdm>=4.66", "pytest>=8",
                      "torchao>=0.16"]


def wheel_dir(wheels: Path, python_version: str) -> Path:
    return wheels / f"cp{python_version.replace('.', '')}"


def has_pip() -> bool:
    return importlib.util.find_spec("pip") is not None


def download(wheels: Path, python_version: str, platforms: list[str]) -> tuple[int, float]:
    """Download the wheels for `python_version` into their folder (emptied first); (exit code, megabytes)."""
    target = wheel_dir(wheels, python_version)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
               "--python-version", python_version, "--dest", str(target),
               *[a for p in platforms for a in ("--platform", p)], *CHECK_REQUIREMENTS]
    print("$", " ".join(command), flush=True)
    run = subprocess.run(command)
    if run.returncode:
        print(f"gpu-check --prepare: pip download for Python {python_version} failed (exit {run.returncode}): it "
              f"needs the package index", file=sys.stderr)
        return 1, 0.0
    found = sorted(target.glob("*.whl"))
    size = sum(w.stat().st_size for w in found) / 2**20
    (target / "manifest.json").write_text(json.dumps(
        {"python_version": python_version, "platforms": platforms, "requirements": CHECK_REQUIREMENTS,
         "wheels": {w.name: w.stat().st_size for w in found}, "megabytes": round(size, 1)}, indent=2))
    for w in found:
        print(f"  {w.stat().st_size / 2**20:6.1f} MB  {w.name}")
    print(f"{len(found)} wheels, {size:.1f} MB in {target}")
    return 0, size


def plan_python() -> Path:
    """The Python that plans the peaks: the project's environment (`uv sync` makes .venv, with torch 2.15), else
    this one."""
    venv = REPO / ".venv" / "bin" / "python"
    return venv if venv.exists() else Path(sys.executable)


def prepare(wheels: Path, python_versions: list[str], platforms: list[str], planned: list[dict],
            planner: Path | None = None) -> int:
    """The wheels for each of `python_versions`, then the plan's peaks of the `planned` stages ({name, args}, in
    planned order) into wheels/PEAKS_FILE; refuse more than WHEELS_LIMIT_MB of wheels."""
    if not has_pip():
        print(f"gpu-check --prepare: {sys.executable} has no pip (a uv environment has none), which downloads the "
              f"wheels: run it with a Python that has pip, e.g. `PYTHON=python3 scripts/gpu-check.sh --prepare` "
              f"(the peaks are planned with {plan_python()} all the same)", file=sys.stderr)
        return 1
    total = 0.0
    for version in python_versions:
        code, size = download(wheels, version, platforms)
        if code:
            return code
        total += size
    print(f"wheels for Python {', '.join(python_versions)}: {total:.1f} MB in {wheels}")
    if total > WHEELS_LIMIT_MB:
        print(f"gpu-check --prepare: {total:.1f} MB is over the {WHEELS_LIMIT_MB} MB limit", file=sys.stderr)
        return 1
    return plan_peaks(wheels, planned, planner or plan_python())


def plan_peaks(wheels: Path, planned: list[dict], planner: Path) -> int:
    """`maester plan`'s per-rank peak of each stage, made by `planner` (a Python with torch >= 2.15), into
    wheels/PEAKS_FILE with the stage's arguments (a changed stage is not compared with a stale figure)."""
    listing = wheels / "plan-stages.json"
    listing.write_text(json.dumps(planned))
    print(f"planning the memory stages with {planner} ...", flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    run = subprocess.run([str(planner), "benchmarks/gpu_check_train.py", "--plan-stages", str(listing)], cwd=REPO,
                         env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    listing.unlink()
    lines = [line[len(PEAKS):] for line in run.stdout.splitlines() if line.startswith(PEAKS)]
    if run.returncode or len(lines) != 1:
        tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or ["(no output)"]
        print(f"gpu-check --prepare: the wheels are ready, the expected peaks are not: {planner} could not plan "
              f"the memory stages (exit {run.returncode}): {tail[0][-400:]}. Plan with torch >= 2.15 (`uv sync` "
              f"makes .venv with it)", file=sys.stderr)
        return 1
    peaks = json.loads(lines[0])
    (wheels / PEAKS_FILE).write_text(json.dumps(peaks, indent=2))
    for name, entry in peaks["stages"].items():
        print(f"  {name}: {entry['planned_peak_gib']:.2f} GiB per rank planned (torch {peaks['torch']})")
    return 0


def expected_peak(wheels: Path, name: str, args: list[str]) -> dict:
    """The stage's planned peak as --prepare made it ({"planned_peak_gib": x}), or why there is none."""
    path = wheels / PEAKS_FILE
    if not path.is_file():
        return {"plan_not_made": f"no {path}: `scripts/gpu-check.sh --prepare` plans the memory stages"}
    entry = json.loads(path.read_text())["stages"].get(name)
    if entry is None or entry["args"] != args:
        return {"plan_not_made": f"{path} was prepared for other arguments of {name}: prepare again"}
    return {"planned_peak_gib": entry["planned_peak_gib"]}


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


def install_wheels(wheels: Path) -> tuple[Path | None, str]:
    """Install the prepared wheels this Python lacks into a folder beside `wheels` (site-cpXY), offline; returns
    (that folder, what happened)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    folder = wheel_dir(wheels, version)
    found = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not found:
        return None, f"no prepared wheels in {folder}"
    if not has_pip():
        return None, f"{sys.executable} has no pip: the prepared wheels in {folder} were not installed"
    site = wheels.parent / f"site-cp{version.replace('.', '')}"
    needed = missing_wheels(found)
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
