"""Phase 3 of the cells (`cells.py`), run in one fresh process for several cells: each checkpoint is converted with
`maester convert to-hf` (before anything imports torchao: `transformers` does, and registers torchao's classes with
torch's unpickler, which would hide a checkpoint that only loads where torchao was imported), loaded as maester's
model to give the logits of a probe, and its export sampled with `maester generate`. `compare` then reads each export
with `transformers` and compares its logits with maester's."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

PROBE = list(b"The model reads a token, then predicts the next one.")[:28]
NEW_TOKENS = 6


def export_checkpoints(spec: str) -> None:
    """`spec`: a JSON file of [{"checkpoint": ..., "out": ...}]; writes `out`/maester-logits.json and a result
    beside the spec (`<spec>.result.json`, per checkpoint: convert's exit code and error output, the text generate
    printed from the export, or from the checkpoint where there is no export; or the error that stopped it)."""
    import torch

    from maester.cli import main
    from maester.tools.generate import load_for_inference

    results = []
    for item in json.loads(Path(spec).read_text()):
        checkpoint, out = Path(item["checkpoint"]), Path(item["out"])
        result: dict = {"torchao_imported": "torchao" in sys.modules}
        try:
            result["convert"], _, result["convert_error"] = _cli(main, ["convert", "to-hf", str(checkpoint),
                                                                        str(out / "hf")])
            model, _, _ = load_for_inference(checkpoint, torch.device("cpu"), torch.float32)
            with torch.no_grad():
                logits = model(torch.tensor([PROBE]))[0]
            out.mkdir(parents=True, exist_ok=True)
            (out / "maester-logits.json").write_text(json.dumps(logits.tolist()))
            target = out / "hf" if result["convert"] == 0 else checkpoint
            code, printed, error = _cli(main, ["generate", str(target), "--prompt", "The model", "--max-new-tokens",
                                               str(NEW_TOKENS), "--device", "cpu"])
            if code:
                raise RuntimeError(f"maester generate {target} exited {code}: {error[-2000:]}")
            result["generated"] = printed
        except Exception as e:  # noqa: BLE001 (reported per checkpoint; the others go on)
            traceback.print_exc()
            result["error"] = f"{type(e).__name__}: {e}"
        results.append(result)
    Path(spec + ".result.json").write_text(json.dumps(results))


def _cli(main, argv: list[str]) -> tuple[int, str, str]:
    """`maester ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stderr.write(err.getvalue())
    return code, out.getvalue(), err.getvalue()


def compare(out: Path, tolerance: float = 1e-4) -> str | None:
    """Why the export in `out`/hf, run by `transformers` in float32, does not give maester's logits; None if it
    does."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor([PROBE])).logits[0]
    expected = torch.tensor(json.loads((out / "maester-logits.json").read_text()))
    vocab = min(hf.shape[-1], expected.shape[-1])
    if hf.shape[-1] != expected.shape[-1] and hf.shape[-1] != vocab:
        return f"the export has {hf.shape[-1]} logits per token, maester {expected.shape[-1]}"
    diff = (hf[:, :vocab] - expected[:, :vocab]).abs().max().item()
    if not diff <= tolerance:
        return f"the export's logits differ from maester's by up to {diff:.3g} (tolerance {tolerance})"
    return None
