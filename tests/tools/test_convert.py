"""`maester convert` between Hugging Face model directories and maester checkpoints, and `maester generate` on
both, checked against `transformers` itself on tiny random models built here (float32, no downloads)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from maester.cli import main
from maester.data.tokenizers import ByteTokenizer
from maester.models.args import TransformerArgs
from maester.models.flavors import LLAMA_FLAVORS
from maester.models.hf import args_from_hf, hf_config, read_hf_config
from maester.models.hf_tensors import read_hf_tensors, state_dict_from_hf
from maester.models.registry import ARCHITECTURES
from maester.tools.convert import choose_flavor, to_hf, write_byte_tokenizer
from maester.tools.generate import load_for_inference, read_prompts, sample
from maester.train.trainer import Trainer
from tests.helpers import run_maester, tiny_overrides
from tests.models.test_hf_parity import random_hf_model, tiny_args

transformers = pytest.importorskip("transformers")

CASES = ("llama", "gemma3", "gpt_neox", "mistral", "qwen2", "gemma2", "phi3")
CONTEXT = 128
PROMPT = "The model reads "
NEW_TOKENS = 24
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MIXED = "ASCII, naïve café, 日本語 and 🙂 <|im_start|>user\nhi<|im_end|><|end_of_text|> tail\t\x00"


def hf_greedy(model, ids: list[int], vocab: int, eos: list[int] | None = None) -> list[int]:
    """transformers' greedy continuation of `ids` among the tokenizer's `vocab` ids (the embedding's padding rows
    beyond them suppressed, as maester's sampler masks them), without the end token it stops at."""
    padding = list(range(vocab, model.config.vocab_size))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, suppress_tokens=padding or None)[0, len(ids):].tolist()
    return out[:-1] if eos and out and out[-1] in eos else out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """A random transformers model of each case, saved with the byte tokenizer's HF files; gpt_neox's weights in
    several shards, llama's tokenizer with a ChatML chat template."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for case in CASES:
        name, args = tiny_args(case)
        model = random_hf_model(name, args.model_copy(update={"max_seq_len": CONTEXT}), seed=3)
        path = root / case
        model.save_pretrained(path, max_shard_size="100KB" if case == "gpt_neox" else "5GB")
        write_byte_tokenizer(path, CONTEXT)
        out[case] = (path, model)
    config = json.loads((root / "llama" / "tokenizer_config.json").read_text())
    (root / "llama" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    assert len(list((root / "gpt_neox").glob("model-*.safetensors"))) > 1
    return out


def maester_cli(args: list[str], capsys=None) -> tuple[int, str, str]:
    """The `maester` command run in this process, which saves the seconds a new interpreter takes to import torch
    (`run_maester` runs it as a user does, once per command): exit code, stdout, stderr."""
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    if capsys is None:
        return code, "", ""
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    """Each HF directory converted by `maester convert from-hf`."""
    root = tmp_path_factory.mktemp("converted")
    for case, (path, _) in hf_dirs.items():
        assert maester_cli(["convert", "from-hf", str(path), str(root / case)])[0] == 0
    return {case: root / case for case in hf_dirs}


@pytest.mark.parametrize("case", CASES)
def test_from_hf_writes_a_checkpoint_that_generates_as_transformers(hf_dirs, converted, case, tmp_path, capsys):
    hf_path, hf_model = hf_dirs[case]
    out = converted[case]
    cfg = json.loads((out / "config.json").read_text())
    # the published flavor closest to the model (tiny), the rest as overrides
    assert cfg["model"] == {"name": case, "flavor": "tiny", "overrides": {"vocab_size": 320, "max_seq_len": CONTEXT},
                            "width": None, "hf_config": None, "attention": "auto"}
    assert cfg["tokenizer"]["kind"] == "hf" and cfg["tokenizer"]["path"] == str((out / "tokenizer").resolve())
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["step"] == 0 and state["converted_from"] == str(hf_path.resolve())

    # the weights are the HF tensors, loaded through the checkpoint code every maester command uses
    model, tokenizer, _ = load_for_inference(out, torch.device("cpu"))
    args = model.args
    expected = state_dict_from_hf(case, args, read_hf_tensors(hf_path))
    assert sorted(model.state_dict()) == sorted(expected)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())

    prompt_ids = list(PROMPT.encode())
    assert tokenizer.vocab_size < args.vocab_size  # the embedding has padding rows, which sampling never picks
    greedy = hf_greedy(hf_model, prompt_ids, tokenizer.vocab_size)
    assert len(greedy) == NEW_TOKENS
    assert sample(model, prompt_ids, NEW_TOKENS, vocab_size=tokenizer.vocab_size) == greedy
    command = ["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]
    if case == "llama":
        run = run_maester(command, tmp_path)
        code, stdout, stderr = run.returncode, run.stdout, run.stderr
    else:
        code, stdout, stderr = maester_cli(command, capsys)
    assert code == 0, stderr
    decode = transformers.AutoTokenizer.from_pretrained(hf_path).decode
    shown = greedy[:greedy.index(tokenizer.eos_id)] if tokenizer.eos_id in greedy else greedy  # generate stops there
    assert stdout == PROMPT + decode(shown) + "\n"


def test_generate_on_an_hf_directory_with_a_prompts_file(hf_dirs, tmp_path, capsys):
    hf_path, hf_model = hf_dirs["llama"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_path)
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "Again,\nplease"}]
    prompts = tmp_path / "smoke.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"messages": messages}) + "\n")
    code, stdout, stderr = maester_cli(["generate", str(hf_path), "--prompts-file", str(prompts), "--max-new-tokens",
                                        str(NEW_TOKENS), "--device", "cpu"], capsys)
    assert code == 0, stderr

    continuation = hf_greedy(hf_model, list(PROMPT.encode()), len(hf_tok))
    chat_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    answer = hf_greedy(hf_model, list(chat_ids), len(hf_tok),
                       eos=[hf_tok.eos_token_id, hf_tok.convert_tokens_to_ids("<|im_end|>")])
    assert stdout == (f"### {prompts}:1\n> {PROMPT}\n{hf_tok.decode(continuation)}\n\n"
                          f"### {prompts}:2\n> user: Say hi\n> assistant: hi\n> user: Again,\n> please\n"
                          f"{hf_tok.decode(answer)}\n\n")

    # a bad line stops the command before any model is loaded, naming the file and line
    prompts.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    code, _, err = maester_cli(["generate", str(hf_path), "--prompts-file", str(prompts)], capsys)
    assert code == 2 and f"{prompts}:2" in err and "message 0" in err
    for text, problem in (("one\n\nthree\n", ":2: empty line"), ('{"prompt": "a", "messages": []}\n', "either")):
        bad = tmp_path / ("bad.txt" if "one" in text else "bad.jsonl")
        bad.write_text(text)
        with pytest.raises(ValueError, match=problem):
            read_prompts(bad)
    # --chat on a directory whose tokenizer has no chat template
    code, _, err = maester_cli(["generate", str(hf_dirs["gpt_neox"][0]), "--prompt", "x", "--chat"], capsys)
    assert code == 2 and "no chat_template" in err


@pytest.mark.parametrize("case", CASES)
def test_from_hf_then_to_hf_gives_the_original_tensors(hf_dirs, converted, case, tmp_path):
    hf_path, _ = hf_dirs[case]
    back = to_hf(converted[case], tmp_path / "back", max_shard_size="50KB")
    original, written = read_hf_tensors(hf_path), read_hf_tensors(back)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
    assert args_from_hf(read_hf_config(back)) == args_from_hf(read_hf_config(hf_path))
    assert (back / "model.safetensors.index.json").is_file()
    tokens = {"bos_token_id": 256, "pad_token_id": 258}
    # llama's tokenizer has a chat template: its end of turn ends generation too
    eos = [257, 263] if case == "llama" else 257
    assert json.loads((back / "generation_config.json").read_text()) == {**tokens, "eos_token_id": eos}
    assert json.loads((back / "tokenizer_config.json").read_text()) == json.loads(
        (hf_path / "tokenizer_config.json").read_text())


def test_to_hf_of_a_trained_job_loads_in_transformers(corpus, tmp_path, capsys):
    cfg_overrides = tiny_overrides(corpus, tmp_path / "jobs", "small", training__steps=2, checkpoint__interval=0)
    from maester.config import load_config

    job = load_config(None, cfg_overrides, environ={}).job_dir
    Trainer(load_config(None, cfg_overrides, environ={}), job).train()
    out = tmp_path / "hf"
    run = run_maester(["convert", "to-hf", str(job), str(out), "--max-shard-size", "20KB"], tmp_path)
    assert run.returncode == 0, run.stderr
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {0o666 & ~umask}  # not 0600

    model, _, _ = load_for_inference(job, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    x = torch.randint(0, ByteTokenizer().vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-4)

    # the byte tokenizer, as transformers loads it: the same ids as maester's for text, the special tokens at their
    # ids, and the same text back
    tok, byte = transformers.AutoTokenizer.from_pretrained(out), ByteTokenizer()
    plain = MIXED.split(" <|")[0]
    assert tok(plain, add_special_tokens=False)["input_ids"] == byte.encode(plain)
    expected = (byte.encode(plain + " ") + [262] + byte.encode("user\nhi") + [263, 257] + byte.encode(" tail\t\x00"))
    assert tok(MIXED, add_special_tokens=False)["input_ids"] == expected
    assert tok.decode(expected) == byte.decode(expected) == MIXED
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (byte.bos_id, byte.eos_id, byte.pad_id)

    code, _, err = maester_cli(["convert", "to-hf", str(job), str(tmp_path / "bf16"), "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    from safetensors import safe_open

    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"

    code, _, err = maester_cli(["convert", "to-hf", str(job), str(out)], capsys)
    assert code == 2 and "already exists" in err


def test_from_hf_refuses_what_it_cannot_do(hf_dirs, tmp_path, capsys, monkeypatch):
    hf_path, _ = hf_dirs["llama"]
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in ("config.json", "model.safetensors"):
        (bare / file).write_bytes((hf_path / file).read_bytes())
    code, _, err = maester_cli(["convert", "from-hf", str(bare), str(tmp_path / "out")], capsys)
    assert code == 2 and "no tokenizer.json" in err and "--no-tokenizer" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))

    code, _, err = maester_cli(["convert", "from-hf", str(bare), str(tmp_path / "out"), "--no-tokenizer"], capsys)
    assert code == 0, err
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    named = str((tmp_path / "out" / "tokenizer").resolve())
    assert (cfg["tokenizer"]["kind"], cfg["tokenizer"]["path"]) == ("hf", named)
    code, _, err = maester_cli(["generate", str(tmp_path / "out"), "--prompt", "x"], capsys)
    assert code == 2 and str(tmp_path / "out" / "tokenizer") in err  # named, never silently replaced

    code, _, err = maester_cli(["convert", "from-hf", str(hf_path), str(tmp_path / "out")], capsys)
    assert code == 2 and "already exists" in err

    (bare / "config.json").write_text(json.dumps({**read_hf_config(hf_path), "model_type": "mamba"}))
    code, _, err = maester_cli(["convert", "from-hf", str(bare), str(tmp_path / "mamba"), "--no-tokenizer"], capsys)
    assert code == 2 and "model_type 'mamba' is not supported" in err

    # --upload without huggingface_hub: a clear error before anything is converted
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ValueError, match=r"maester\[hub\]"):
        to_hf(tmp_path / "out", tmp_path / "up", upload="org/name")
    assert not (tmp_path / "up").exists()


def test_the_chooser_names_the_published_flavor_or_the_closest_with_overrides():
    for name, arch in ARCHITECTURES.items():
        for flavor, args in arch.flavors.items():
            assert choose_flavor(name, args) == (flavor, {}), (name, flavor)
    eight_b = LLAMA_FLAVORS["8B"]
    assert choose_flavor("llama", eight_b.model_copy(update={"n_layers": 2, "rope_theta": 1e4})) == (
        "8B", {"n_layers": 2, "rope_theta": 1e4})
    # what Llama 3.1 8B's config.json says is the 8B flavor
    _, fields = args_from_hf(hf_config("llama", eight_b))
    assert choose_flavor("llama", TransformerArgs(**fields)) == ("8B", {})
    # head_dim counts as resolved: None and dim // n_heads are the same model
    assert choose_flavor("llama", eight_b.model_copy(update={"head_dim": 128})) == ("8B", {})
