"""`maester convert`: Hugging Face model directories <-> maester checkpoints.

`from_hf`: an HF directory (config.json, safetensors, tokenizer files) becomes a maester checkpoint directory that
everything reading checkpoints takes (`checkpoint.init_from`, `maester generate`, `to_hf`): the model state in DCP
as `Checkpointer.save` writes it, config.json (a full maester config naming the architecture and the flavor it
equals, or the closest flavor plus `overrides`), the tokenizer files under `tokenizer/`, and trainer_state.json
(step 0, `converted_from`).

`to_hf`: a maester checkpoint becomes an HF directory that `transformers` loads with `from_pretrained`: config.json,
safetensors (sharded above a size, with model.safetensors.index.json), generation_config.json and tokenizer files.

Both write OUT under a temporary sibling name and rename it when complete; an existing OUT is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from maester.config import Config
from maester.data.tokenizers import ByteTokenizer, build_tokenizer, tokenizer_path
from maester.files import fsync_dir, fsync_file, parse_shard_size, read_json_object, umask_mode
from maester.parallel.precision import DTYPES
from maester.tools.hf_dir import hf_tokenizer_settings
from maester.tools.model_card import model_card
from maester.train.checkpoint_files import read_trainer_state
from maester.models.args import TransformerArgs
from maester.progress import stages
from maester.models.hf import check_convertible, hf_config, read_hf_config, transformer_args_from_hf
from maester.models.hf_tensors import read_hf_tensors, state_dict_from_hf, state_dict_to_hf, write_hf_tensors
from maester.models.registry import ARCHITECTURES

# Tokenizer files an HF directory may hold; tokenizer.json is the one maester reads, the others name its special
# tokens and chat template.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
TOKENIZER_DIR = "tokenizer"
# Ignored when picking a flavor: the kernel choice is not an architecture field.
_NOT_ARCHITECTURE = ("attention",)


# ---------------------------------------------------------------- HF -> maester


def from_hf(hf_dir: str | Path, out: str | Path, *, dtype: str = "float32", tokenizer: bool = True) -> Path:
    """Convert the HF model directory `hf_dir` (or Hub id `org/name[@revision]`, fetched into the Hugging Face
    cache) into the maester checkpoint directory `out`; returns `out`."""
    from maester.hub import is_hub_id, local_path

    origin = str(hf_dir) if is_hub_id(str(hf_dir)) else str(Path(hf_dir).resolve())
    out = Path(out)
    _refuse_existing(out)
    hf_dir = local_path(str(hf_dir), "convert from-hf")
    hf = read_hf_config(hf_dir)
    name, args = transformer_args_from_hf(hf, str(hf_dir / "config.json"))
    if tokenizer and not (hf_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{hf_dir}: no tokenizer.json (maester reads the fast-tokenizer file): copy the model's tokenizer.json "
            f"and tokenizer_config.json into {hf_dir}, or convert the weights alone with --no-tokenizer and put "
            f"them into {out / TOKENIZER_DIR}/ later")
    flavor, overrides = choose_flavor(name, args)
    with stages("convert", ["read safetensors", "write checkpoint"]) as next_stage:
        next_stage()
        state = state_dict_from_hf(name, args, read_hf_tensors(hf_dir), where=str(hf_dir))
        state = {k: v.to(_dtype(dtype)) for k, v in state.items()}
        next_stage()
        final_tokenizer = out.resolve() / TOKENIZER_DIR
        tree: dict[str, Any] = {"job": {"name": _job_name(out)},
                                "model": {"name": name, "flavor": flavor, "overrides": overrides}}
        with _atomic_directory(out) as tmp:
            if tokenizer:
                (tmp / TOKENIZER_DIR).mkdir()
                for file in TOKENIZER_FILES:
                    if (hf_dir / file).is_file():
                        shutil.copyfile(hf_dir / file, tmp / TOKENIZER_DIR / file)
                try:
                    settings = hf_tokenizer_settings(tmp / TOKENIZER_DIR, hf)
                except (ValueError, OSError) as e:  # named by its source, not by the temporary copy
                    raise ValueError(str(e).replace(str(tmp / TOKENIZER_DIR), str(hf_dir))) from None
                _check_tokenizer_fits(Config.model_validate({**tree, **settings}))
                settings["tokenizer"]["path"] = str(final_tokenizer)
                tree.update(settings)
            else:  # named, not guessed: using it fails until the files are there
                tree["tokenizer"] = {"kind": "hf", "path": str(final_tokenizer)}
            cfg = Config.model_validate(tree)
            if cfg.model.architecture().differences(args, ignore=_NOT_ARCHITECTURE):
                raise AssertionError(f"flavor {flavor!r} with overrides {overrides} does not rebuild {hf_dir}'s model")
            _save_model_state(tmp, name, args, state)
            _write_json(tmp / "config.json", cfg.model_dump(mode="json"))
            _write_json(tmp / "trainer_state.json", {"step": 0, "converted_from": origin,
                                                     "dtype": dtype})
    return out


def choose_flavor(name: str, args: TransformerArgs) -> tuple[str, dict[str, Any]]:
    """The flavor of architecture `name` that `args` equals, with no overrides; else the flavor with the fewest
    differing fields and those fields as overrides (the first such flavor in the registry's order)."""
    best: tuple[str, dict[str, Any]] | None = None
    for flavor, ref in ARCHITECTURES[name].flavors.items():
        differing = {k: ours for k, (ours, _) in args.differences(ref, ignore=_NOT_ARCHITECTURE).items()}
        if best is None or len(differing) < len(best[1]):
            best = (flavor, differing)
    assert best is not None
    return best


def _check_tokenizer_fits(cfg: Config) -> None:
    """The tokenizer builds from the copied files, and its vocabulary fits the model's."""
    from maester.models.build import resolve_args

    resolve_args(cfg.model, build_tokenizer(cfg.tokenizer).vocab_size, cfg.mup)


def _save_model_state(directory: Path, name: str, args: TransformerArgs, state: dict[str, torch.Tensor]) -> None:
    """The model state in DCP under "model.*" keys, exactly as `Checkpointer.save` writes a model: the tensors are
    put into a maester model of `args` (every parameter filled, none left over) and its state dict is saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with torch.device("meta"):
        model = ARCHITECTURES[name].model_class()(args)
    model.load_state_dict(state, strict=True, assign=True)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=directory)


# ---------------------------------------------------------------- maester -> HF


def to_hf(target: str | Path, out: str | Path, *, dtype: str = "float32", max_shard_size: str = "5GB",
          tokenizer: bool = True, upload: str | None = None, revision: str | None = None,
          base_model: str | None = None) -> Path:
    """Convert the checkpoint of `target` (a checkpoint or job directory) into the HF model directory `out`, with a
    model card naming the job, the step and `base_model`, then upload it to the Hub repository `upload` if given, on
    the branch `revision` (created from main if absent); returns `out`."""
    from maester.models.build import resolve_args
    from maester.tools.generate import load_checkpoint_model
    from maester.train.checkpoint import resolve_checkpoint

    out = Path(out)
    _refuse_existing(out)
    try:
        max_bytes = parse_shard_size(max_shard_size)
    except ValueError as e:
        raise ValueError(f"--max-shard-size {max_shard_size!r}: {e}") from None
    _check_upload_options(upload, revision, base_model)
    if upload is not None:
        _hub_api(upload)  # fail before converting when the upload cannot happen
    path = resolve_checkpoint(target)
    cfg = Config.from_json_file(path / "config.json")
    tok = build_tokenizer(cfg.tokenizer)  # its ids go into config.json; it sizes a flavor's vocabulary
    if tokenizer and cfg.tokenizer.kind not in ("hf", "byte"):
        raise ValueError(f"{path / 'config.json'}: tokenizer.kind = {cfg.tokenizer.kind!r} cannot be written as HF "
                         f"tokenizer files (hf and byte can): pass --no-tokenizer and add the model's tokenizer.json "
                         f"to {out} yourself")
    name = cfg.model.name
    check_convertible(name, resolve_args(cfg.model, tok.vocab_size, cfg.mup))
    with stages("convert", ["load checkpoint", "write safetensors"] + (["upload"] if upload else [])) as next_stage:
        next_stage()
        model = load_checkpoint_model(path, cfg, tok, torch.device("cpu"))
        args = model.args
        tensors = {k: v.to(_dtype(dtype)) for k, v in state_dict_to_hf(name, args, model.state_dict()).items()}
        del model
        next_stage()
        with _atomic_directory(out) as tmp:
            write_hf_tensors(tmp, tensors, max_bytes)
            _write_json(tmp / "config.json", hf_config(name, args, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                                       pad_id=tok.pad_id, dtype=dtype))
            _write_json(tmp / "generation_config.json", generation_config(cfg, tok))
            if tokenizer:
                write_tokenizer_files(cfg, tok, tmp, args.max_seq_len, read_json_object(tmp / "config.json"))
            (tmp / "README.md").write_text(model_card(job=cfg.job.name, step=read_trainer_state(path)["step"],
                                                      checkpoint=path, architecture=name, base_model=base_model))
        if upload is not None:
            next_stage()
            upload_folder(out, upload, revision)
    return out


def _has_chat_template(cfg: Config) -> bool:
    """Whether the model was fine-tuned on conversations (`data.mode = "sft"`) or the config names the tokenizer's
    own template (`jinja`): its chat template goes with it."""
    return cfg.data.mode == "sft" or cfg.data.sft.template == "jinja"


# A conversation that shows every part of a chat template: turns of both roles, a second answer after a question.
_PROBE = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
          {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6."}]


def write_chat_template(cfg: Config, tokenizer, directory: Path, hf: dict) -> None:
    """Put the chat template the job trained with (`data.sft`: a built-in layout, the markers with their special
    tokens, or a Jinja template) into the exported tokenizer_config.json, so that `apply_chat_template`, `maester
    chat` on the directory and the job's own encoding give the same ids; checked on a probe conversation. A
    tokenizer's own template (`jinja` without `chat_template_path`) stays as it was copied."""
    from maester.data.chat import ChatEncoder
    from maester.data.chat.jinja import JinjaTemplate

    ours = ChatEncoder(tokenizer, cfg.data.sft, cfg.tokenizer.path)
    sft = cfg.data.sft
    if sft.template != "jinja" or sft.chat_template_path:
        file = directory / "tokenizer_config.json"
        _write_json(file, {**read_json_object(file), "chat_template": ours.chat_template()})
        (directory / "chat_template.jinja").unlink(missing_ok=True)  # transformers would take it over the config's
    settings = hf_tokenizer_settings(directory, hf)
    exported = JinjaTemplate(build_tokenizer(Config.model_validate(settings).tokenizer),
                             sft.model_copy(update={"template": "jinja", "chat_template_path": None,
                                                    "system_prompt": None}), str(directory))
    probe = _probe(ours)
    for what, mine, theirs in (("prompt", ours.prompt(probe[:3])[0], exported.prompt_ids(probe[:3])),
                               ("conversation", ours.encode(probe).tokens.tolist(),
                                exported.encode_messages(probe).tokens.tolist())):
        if mine != theirs:
            raise ValueError(f"the exported chat template does not give the job's {what} ids for a probe "
                             f"conversation: {mine} here, {theirs} from the exported tokenizer files (are the "
                             f"template's special tokens added tokens of tokenizer.json?); pass --no-tokenizer and "
                             f"write the tokenizer files yourself")


def _probe(encoder) -> list[dict]:
    """_PROBE, its questions in the format's user role."""
    return [{**m, "role": encoder.user_role} if m["role"] == "user" else m for m in _PROBE]


def generation_config(cfg: Config, tokenizer) -> dict[str, Any]:
    """BOS, EOS and pad ids for HF's `generate`; EOS also lists the chat template's end of turn when the template
    goes with the model (`_has_chat_template`)."""
    eos: list[int] = [tokenizer.eos_id]
    if _has_chat_template(cfg):
        from maester.data.chat import ChatEncoder

        eos += sorted(ChatEncoder(tokenizer, cfg.data.sft, cfg.tokenizer.path).stop_ids() - {tokenizer.eos_id})
    out: dict[str, Any] = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
                           "pad_token_id": tokenizer.pad_id}
    return {k: v for k, v in out.items() if v is not None}


def write_tokenizer_files(cfg: Config, tokenizer, directory: Path, max_seq_len: int, hf: dict) -> None:
    """The job's tokenizer as HF files in `directory` (the model's `hf` config.json is there), with the chat
    template it trained with where it has one (`_has_chat_template`)."""
    if cfg.tokenizer.kind == "byte":
        write_byte_tokenizer(directory, max_seq_len)
    else:
        _copy_hf_tokenizer(cfg, directory)
    if _has_chat_template(cfg):
        write_chat_template(cfg, tokenizer, directory, hf)


def _copy_hf_tokenizer(cfg: Config, directory: Path) -> None:
    source = tokenizer_path(cfg.tokenizer)
    source_dir = source if source.is_dir() else source.parent
    shutil.copyfile(source_dir / "tokenizer.json" if source.is_dir() else source, directory / "tokenizer.json")
    for file in TOKENIZER_FILES[1:]:
        if (source_dir / file).is_file():
            shutil.copyfile(source_dir / file, directory / file)
    named = {f"{k}_token": getattr(cfg.tokenizer, f"{k}_token") for k in ("bos", "eos", "pad")
             if getattr(cfg.tokenizer, f"{k}_token") is not None}
    if named:  # the config's choice, where it overrides tokenizer_config.json's
        file = directory / "tokenizer_config.json"
        _write_json(file, {**(read_json_object(file) if file.is_file() else {}), **named})


def write_byte_tokenizer(directory: str | Path, model_max_length: int | None = None) -> None:
    """tokenizer.json and tokenizer_config.json of maester's byte tokenizer for HF: a byte-level BPE without merges
    whose ids are the byte values 0-255, then the special tokens at maester's ids (256-268). Text encodes to its
    UTF-8 bytes; special-token text maps to the special token's id, as HF tokenizers (and maester's chat encoding)
    do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    byte_chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ByteTokenizer.SPECIAL_TOKENS])
    byte = ByteTokenizer()
    for token in ByteTokenizer.SPECIAL_TOKENS:
        if tok.token_to_id(token) != byte.token_to_id(token):
            raise AssertionError(f"{token} got id {tok.token_to_id(token)}, maester's is {byte.token_to_id(token)}")
    tok.save(str(directory / "tokenizer.json"))
    specials = ByteTokenizer.SPECIAL_TOKENS
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[byte.bos_id - 256],
        "eos_token": specials[byte.eos_id - 256], "pad_token": specials[byte.pad_id - 256],
        "additional_special_tokens": list(specials[3:]), "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    _write_json(directory / "tokenizer_config.json", config)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the ByteLevel pre-tokenizer's mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


# ---------------------------------------------------------------- the Hub


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REVISION = re.compile(r"^[A-Za-z0-9][\w.\-/]*$")


def _hub_api(repo_id: str):
    if not _REPO_ID.match(repo_id):
        raise ValueError(f"--upload {repo_id!r}: expected a Hub repository as ORG/NAME")
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError("--upload needs huggingface_hub, which is not installed: install maester's `hub` extra "
                         "(pip install 'maester[hub]')") from None
    return huggingface_hub.HfApi()


def _check_upload_options(upload: str | None, revision: str | None, base_model: str | None) -> None:
    if revision is not None and upload is None:
        raise ValueError(f"--revision {revision!r} names the branch to upload to: it needs --upload ORG/NAME")
    if revision is not None and not _REVISION.match(revision):
        raise ValueError(f"--revision {revision!r}: expected a branch name such as step-400 (letters, digits, "
                         "'.', '_', '-', '/')")
    if base_model is not None and not _REPO_ID.match(base_model):
        raise ValueError(f"--base-model {base_model!r}: expected a Hub repository as ORG/NAME")


def upload_folder(directory: Path, repo_id: str, revision: str | None = None) -> None:
    """Create the Hub model repository `repo_id` if needed and upload `directory` into it, on the branch `revision`
    (created from main if absent; default main). Credentials as huggingface_hub finds them: HF_TOKEN or `hf auth
    login`."""
    import huggingface_hub

    from maester.data.hub_datasets import network_errors

    api = _hub_api(repo_id)
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        api.upload_folder(folder_path=str(directory), repo_id=repo_id, repo_type="model", revision=revision)
    except network_errors(huggingface_hub) as e:  # HTTP errors, offline mode, no connection
        again = f"hf upload {repo_id} {directory}" + (f" --revision {revision}" if revision else "")
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"--upload {repo_id}: {reason} ({directory} is complete; upload it again with "
                         f"`{again}`)") from None


# ---------------------------------------------------------------- files


def _refuse_existing(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise ValueError(f"{out} already exists: give a new output directory (nothing is overwritten)")


@contextmanager
def _atomic_directory(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to fill; renamed to `out` on a clean exit (after every file is synced),
    removed on an error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        mode = umask_mode()
        for file in tmp.rglob("*"):
            if file.is_file():
                os.chmod(file, mode)  # safetensors creates its files 0600 whatever the umask
                fsync_file(file)
        _refuse_existing(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _job_name(out: Path) -> str:
    """The output directory's name as a job name (characters a job name may not hold become '-')."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", out.resolve().name).lstrip(".")
    return name or "converted"
