"""The model card (`README.md` with YAML front matter) that `maester convert to-hf` writes beside the weights: what
the Hub shows on the model's page and reads for its metadata (`base_model`, `library_name`, `tags`), and which maester
job and step the weights came from."""

from __future__ import annotations

from pathlib import Path

import yaml


def model_card(*, job: str, step: int, checkpoint: Path, architecture: str, base_model: str | None) -> str:
    """The card's text: front matter for the Hub, then a short account of where the weights came from."""
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": ["maester", architecture]}
    if base_model is not None:
        meta = {"base_model": base_model, **meta}
    lines = [f"# {job} (step {step})", "",
             f"Weights of the maester job `{job}` at step {step} (checkpoint `{checkpoint.name}`), written by "
             "`maester convert to-hf` as a Hugging Face `transformers` model directory."]
    if base_model is not None:
        lines += ["", f"Trained from [{base_model}](https://huggingface.co/{base_model})."]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + "\n".join(lines) + "\n"
