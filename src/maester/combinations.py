"""Features as users combine them: the factors of the combination matrix (tests/combinations), the one table of the
combinations maester refuses (`REFUSALS`), and the supported-combinations page made from both
(docs/combinations.md, `page`). A test runs the matrix and compares what maester refuses with this table; another
checks that the committed page is the one `page` writes. No torch here.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

FACTORS: dict[str, dict[str, str]] = {
    "layout": {
        "one": "one process",
        "fsdp": "FSDP2 over 2 processes (`parallel.dp_shard = 2`)",
        "hsdp": "HSDP over 2 x 2 processes (`parallel.dp_replicate = 2`, `dp_shard = 2`)",
        "ddp": "DDP over 2 processes (`parallel.dp_replicate = 2`, `dp_shard = 1`)",
        "tp": "tensor and sequence parallel over 2 processes (`parallel.tp = 2`)",
        "pp": "2 pipeline stages, 1F1B (`parallel.pp = 2`)",
        "cp": "context parallel over 2 processes (`parallel.cp = 2`)",
        "ep": "expert parallel over the 2 FSDP ranks (`parallel.dp_shard = 2`, `ep = 2`)",
        "tp_fsdp": "TP 2 x FSDP 2 over 4 processes (`parallel.tp = 2`, `dp_shard = 2`)",
    },
    "precision": {
        "fp32": "`training.precision = \"fp32\"`",
        "bf16": "`training.precision = \"auto\"`: bf16 on a GPU (autocast, or FSDP's mixed precision)",
        "bf16-pure": "`training.precision = \"bf16-pure\"` (bf16 parameters and optimizer state)",
        "fp16": "`training.precision = \"fp16\"` with dynamic loss scaling",
        "float8-tensorwise": "`training.float8`, tensorwise scales, in bf16 mixed precision",
        "float8-rowwise": "`training.float8`, rowwise scales, in bf16 mixed precision",
    },
    "optimizer": {
        "adamw": "`optimizer.name = \"adamw\"`",
        "muon": "`optimizer.name = \"muon\"` (Muon for hidden matrices, AdamW for the rest)",
        "torch": "a torch.optim class by name (`optimizer.name = \"RMSprop\"`)",
    },
    "mup": {
        "off": "standard parametrization",
        "on": "μP (`mup.enabled = true`, at twice its base width)",
    },
    "compile": {
        "off": "eager",
        "on": "`parallel.compile = true` (each block compiled)",
    },
    "ac": {
        "none": "no activation checkpointing",
        "selective": "`parallel.activation_checkpointing = \"selective-op\"`",
        "full": "`parallel.activation_checkpointing = \"full\"`",
    },
    "data": {
        "text": "raw text (Parquet) tokenized on the fly",
        "indexed": "a Megatron indexed dataset (`.bin`/`.idx`)",
        "sft": "conversations (`data.mode = \"sft\"`) packed with document masks (`data.document_masking = true`)",
        "labels": "SFT from GPT-NeoX-style indexed text and label files (`maester data tokenize --template`)",
    },
    "checkpoint": {
        "sync": "`checkpoint.async_mode = \"off\"`",
        "async": "`checkpoint.async_mode = \"auto\"`: written in the background on a GPU",
        "pinned": "`checkpoint.async_mode = \"pinned\"` (page-locked staging buffers)",
    },
    "family": {
        "dense": "Llama",
        "sliding": "Gemma 3 (sliding-window and global layers)",
        "moe": "OLMoE (a mixture of experts)",
    },
    "load": {
        "continue": "a new job continuing another's checkpoint (`checkpoint.load_mode = \"continue\"`)",
        "model_only": "the weights of another job's checkpoint (`checkpoint.load_mode = \"model_only\"`)",
        "hf": "fine-tuning from a Hugging Face directory (`checkpoint.init_from = \"hf:...\"`)",
    },
}
"""Each factor's values, with what a run of that value sets (the matrix's tiny runs set the same)."""

FLOAT8 = ("float8-tensorwise", "float8-rowwise")
ALL_BUT_MOE = ("dense", "sliding")


@dataclass(frozen=True)
class Refusal:
    """A combination maester refuses before its first step: every factor in `when` takes one of its values."""

    when: dict[str, tuple[str, ...]]
    why: str
    """Why, for the page."""
    message: str
    """A piece of the error maester gives (what the matrix looks for)."""
    where: str = "everywhere"
    """`everywhere`, `cpu` (a CPU run refuses it, a GPU run does not) or `gpu`."""
    stage: str = "train"
    """`train`: `maester train` refuses the run before its first step; `export`: the run trains, and `maester
    convert to-hf` refuses to export its checkpoints (they still load in `maester generate`, `eval`, `chat`)."""

    def applies(self, cell: dict[str, str], device: str = "cpu", stage: str | None = "train") -> bool:
        if self.where not in ("everywhere", device) or stage not in (None, self.stage):
            return False
        return all(cell.get(factor) in values for factor, values in self.when.items())


REFUSALS: list[Refusal] = [
    Refusal({"checkpoint": ("pinned",)}, "page-locked staging buffers need CUDA",
            "async_mode = 'pinned' stages checkpoints in page-locked host memory", where="cpu"),
    Refusal({"layout": ("ep",), "family": ALL_BUT_MOE}, "expert parallel splits a mixture of experts' experts",
            "is a dense model: set parallel.ep = 1"),
    Refusal({"layout": ("cp",), "family": ("moe",)},
            "a mixture of experts' load-balancing loss and expert bias would see one cp rank's tokens only",
            "with a mixture of experts"),
    Refusal({"layout": ("ep",), "ac": ("selective",)},
            "the experts' own FSDP unit has hooks that selective checkpointing cannot replay",
            "selective checkpointing cannot replay"),
    Refusal({"layout": ("ddp",), "precision": FLOAT8},
            "torchao's float8 composes with FSDP2 and tensor parallel, not DDP",
            "training.float8 with DDP"),
    Refusal({"optimizer": ("muon",), "family": ("moe",)},
            "Muon orthogonalises matrices; the routed experts' weights are 3-D (one matrix per expert)",
            "to Muon, which takes matrices only"),
    Refusal({"layout": ("pp",), "family": ("moe",)},
            "the auxiliary losses and the balancing of a mixture of experts are not carried between pipeline stages",
            "does not support a mixture-of-experts model"),
    Refusal({"layout": ("pp",), "family": ("sliding",)},
            "Gemma ties its output layer to the embedding, and the last pipeline stage would need the first "
            "stage's embedding",
            "does not support tied embeddings"),
    Refusal({"layout": ("pp",), "load": ("hf",)},
            "a pipeline stage holds some layers only, and a Hugging Face directory is read whole on rank 0; a DCP "
            "checkpoint (`maester convert from-hf` makes one) loads at any pp",
            "does not support loading a Hugging Face directory"),
    Refusal({"mup": ("on",), "load": ("hf",)},
            "a Hugging Face directory holds no μP multipliers, so its model is not the μP run's",
            "in mup (run MupConfig(enabled=True"),
    Refusal({"mup": ("on",)},
            "Hugging Face's architectures have no μP multipliers; a μP model exports only where they are all 1 "
            "(width multiplier 1, both alphas 1, no base_head_dim)",
            "has no μP multipliers", stage="export"),
    Refusal({"precision": FLOAT8, "compile": ("off",)},
            "torch.compile fuses torchao's amax, scale and cast kernels; eager float8 costs more than it saves",
            "training.float8 needs parallel.compile = true", where="gpu"),
]
"""The combinations maester refuses, with the reason; the matrix checks that it refuses exactly these."""


def refusals_of(cell: dict[str, str], device: str = "cpu", stage: str | None = "train") -> list[Refusal]:
    """The table's entries that refuse `cell` (factor -> value; some factors may have no value yet) on `device`
    (`cpu` or `gpu`) at `stage` (`train`, `export`; None: either)."""
    return [r for r in REFUSALS if r.applies(cell, device, stage)]


# the factors the table names, the most named first: a search that gives them values first meets a dead end soonest
_NAMED = [f for f in sorted(FACTORS, key=lambda f: -sum(f in r.when for r in REFUSALS))
          if any(f in r.when for r in REFUSALS)]


@functools.cache
def _accepted(partial: frozenset, device: str, allowed: frozenset[int]) -> bool:
    cell = dict(partial)
    if {REFUSALS.index(r) for r in refusals_of(cell, device)} - allowed:
        return False
    factor = next((f for f in _NAMED if f not in cell), None)
    return factor is None or any(_accepted(partial | {(factor, v)}, device, allowed) for v in FACTORS[factor])


def accepted(cell: dict[str, str], device: str = "cpu", allowed: frozenset[int] = frozenset()) -> bool:
    """Whether the other factors can take values that make `cell` a run `maester train` accepts on `device`, or one
    refused by no entry but those of `allowed` (indices into `REFUSALS`)."""
    return _accepted(frozenset((f, v) for f, v in cell.items() if f in _NAMED), device, allowed)


def _pair_mark(pair: dict[str, str]) -> str:
    """How the grid of the page shows a pair on a GPU: `yes`, or `refused (n, ...)` with the table's numbers."""
    direct = refusals_of(pair, "gpu")
    if direct:
        return "refused (" + ", ".join(str(REFUSALS.index(r) + 1) for r in direct) + ")"
    if accepted(pair, "gpu"):
        return "yes"
    for factor in _NAMED:  # every value of one other factor is refused with the pair: name those refusals
        found = [refusals_of({**pair, factor: v}, "gpu") for v in FACTORS[factor] if factor not in pair]
        if found and all(found):
            return "refused (" + ", ".join(sorted({str(REFUSALS.index(r) + 1) for rs in found for r in rs},
                                                  key=int)) + ")"
    return "refused"


BEGIN = "<!-- generated by maester.combinations.page(): edit the table there, not here -->"
END = "<!-- end of the generated part -->"


def page() -> str:
    """The generated part of docs/combinations.md: the factors, the refused combinations and, for each two factors
    that have a refused pair, which pairs train and which are refused."""
    lines = [BEGIN, "", "### Factors", "", "| Factor | Value | What the run sets |", "|---|---|---|"]
    for factor, values in FACTORS.items():
        for i, (value, text) in enumerate(values.items()):
            lines.append(f"| {factor if i == 0 else ''} | `{value}` | {text} |")
    lines += ["", "### Refused combinations", "", "| # | Combination | Refused | Why |", "|---|---|---|---|"]
    for i, r in enumerate(REFUSALS, 1):
        combination = " with ".join(f"{factor} {' or '.join(f'`{v}`' for v in values)}"
                                    for factor, values in r.when.items())
        where = {"everywhere": "", "cpu": " on the CPU", "gpu": " on GPUs"}[r.where]
        stage = "by `maester train`, before step 1" if r.stage == "train" else "by `maester convert to-hf`"
        lines.append(f"| {i} | {combination} | {stage}{where} | {r.why} |")
    lines += ["", "### Pairs on GPUs", "",
              "Each grid is two factors that have a pair `maester train` refuses on GPUs, by the number of the "
              "refusal above (a pair whose every run is refused names the refusals that close it); every pair of "
              "two factors not shown trains. Refusals of one value alone (the CPU's `pinned`, μP's export) are "
              "left out of the grids.", ""]
    for fa, fb in itertools.combinations(FACTORS, 2):
        marks = {(va, vb): _pair_mark({fa: va, fb: vb}) for va in FACTORS[fa] for vb in FACTORS[fb]}
        if all(m == "yes" for m in marks.values()):
            continue
        lines += [f"**{fa} x {fb}**", "", f"| {fa} \\ {fb} | " + " | ".join(f"`{v}`" for v in FACTORS[fb]) + " |",
                  "|---" * (len(FACTORS[fb]) + 1) + "|"]
        lines += [f"| `{va}` | " + " | ".join(marks[va, vb] for vb in FACTORS[fb]) + " |" for va in FACTORS[fa]]
        lines.append("")
    return "\n".join(lines + [END]) + "\n"


def update_page(path) -> bool:
    """Write `page()` between the markers of the page at `path`; returns whether that changed it."""
    from pathlib import Path

    text = Path(path).read_text()
    head, rest = text.split(BEGIN, 1)
    new = head + page() + rest.split(END, 1)[1].removeprefix("\n")
    if new != text:
        Path(path).write_text(new)
    return new != text
