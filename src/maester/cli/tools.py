"""The commands on checkpoints and models: generate, convert, verify, plot, report. Each is an `add_*` (its
arguments) and a `run_*` (what it does, importing torch only there)."""

from __future__ import annotations

import sys

from maester import exit_codes


def add_generate(sub, name: str) -> None:
    p = sub.add_parser(name, help="sample text from a job's latest checkpoint, a checkpoint directory or a "
                                        "Hugging Face model directory")
    p.add_argument("target", help="a job directory, a checkpoint directory, or an HF model directory (config.json, "
                                  "safetensors, tokenizer.json)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompts-file", metavar="FILE",
                        help="a smoke suite: one prompt per line, or (.jsonl) one {\"prompt\": ...} or "
                             "{\"messages\": [...]} per line; each result is printed under its prompt")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of tokens holding this "
                                                             "share of the probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message in the chat template (the job's data.sft, or an HF "
                        "directory's own chat_template) and print the assistant's answer, up to its end of turn")


def run_generate(args) -> None:
    from maester.parallel.dims import init_distributed
    from maester.tools.hf_dir import is_hf_model_dir
    from maester.tools.generate import Completer, Prompt, load_for_inference, read_prompts

    prompts = read_prompts(args.prompts_file) if args.prompts_file else [Prompt("--prompt", text=args.prompt)]
    _, _, device = init_distributed(args.device)  # one process: no process group, just the device
    model, tokenizer, cfg = load_for_inference(args.target, device)
    chat = args.chat or any(p.messages is not None for p in prompts)
    if chat and is_hf_model_dir(args.target) and cfg.data.sft.template != "jinja":
        raise ValueError(f"{args.target}: --chat and conversation prompts use the model's chat template, but its "
                         f"tokenizer_config.json has no chat_template (and there is no chat_template.jinja)")
    completer = Completer(model, tokenizer, cfg, chat=args.chat, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if not args.prompts_file:
        out = completer.complete(prompts[0])
        print(out if args.chat else args.prompt + out)
        return
    for prompt in prompts:
        shown = ([f"{m['role']}: {m['content']}" for m in prompt.messages] if prompt.messages is not None
                 else [prompt.text])
        print(f"### {prompt.where}")
        print("\n".join("> " + line for text in shown for line in text.split("\n")))
        print(completer.complete(prompt), end="\n\n", flush=True)


def add_convert(sub, name: str) -> None:
    p = sub.add_parser(name, help="convert between Hugging Face model directories and maester checkpoints")
    vsub = p.add_subparsers(dest="convert_command", required=True, metavar="DIRECTION")
    f = vsub.add_parser("from-hf", help="an HF model directory -> a maester checkpoint directory")
    f.add_argument("hf_dir", metavar="HF_DIR", help="config.json, model.safetensors (or sharded, with its index), "
                                                    "tokenizer.json")
    f.add_argument("out", metavar="OUT", help="the checkpoint directory to write (must not exist)")
    f.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the dtype of the stored weights (default: float32, for training)")
    f.add_argument("--no-tokenizer", action="store_true",
                   help="convert the weights alone; the config then names OUT/tokenizer/ for the tokenizer files")
    t = vsub.add_parser("to-hf", help="a maester checkpoint -> an HF model directory")
    t.add_argument("target", metavar="CHECKPOINT_OR_JOB", help="a checkpoint directory or a job directory (its latest)")
    t.add_argument("out", metavar="OUT", help="the HF directory to write (must not exist)")
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the dtype of the written weights (default: float32)")
    t.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="write shards of at most SIZE (5GB, 500MB, 2GiB) with model.safetensors.index.json when "
                        "the weights are larger (default: 5GB)")
    t.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    t.add_argument("--upload", metavar="ORG/NAME",
                   help="then upload OUT to this Hugging Face Hub repository (needs the `hub` extra)")


def run_convert(args) -> None:
    from maester.tools.convert import from_hf, to_hf

    if args.convert_command == "from-hf":
        out = from_hf(args.hf_dir, args.out, dtype=args.dtype, tokenizer=not args.no_tokenizer)
        print(f"wrote the checkpoint {out} (from {args.hf_dir})")
        if args.no_tokenizer:
            print(f"no tokenizer: put the model's tokenizer.json and tokenizer_config.json into {out}/tokenizer/ "
                  f"before generating from it or converting it back", file=sys.stderr)
        return
    out = to_hf(args.target, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                tokenizer=not args.no_tokenizer, upload=args.upload)
    print(f"wrote the Hugging Face model directory {out}" + (f"; uploaded to {args.upload}" if args.upload else ""))


def add_checkpoint(sub, name: str) -> None:
    p = sub.add_parser(name, help="checkpoint tools: verify")
    ksub = p.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    q = ksub.add_parser("verify", help="check checkpoints against their manifests (every file's size and CRC-32); "
                                       "exit 0 when all are intact, 1 when one is damaged")
    q.add_argument("target", help="a job directory, its checkpoints/ directory or one checkpoint")
    q.add_argument("--level", choices=("size", "full"), default="full",
                   help="size: compare file sizes only; full (default): also read every file for its CRC-32")


def run_checkpoint(args) -> None:
    from pathlib import Path

    from maester.train.checkpoint_files import step_dirs, verify_checkpoint

    target = Path(args.target)
    if (target / ".metadata").is_file() or (target / "manifest.json").is_file():
        checkpoints = [target]
    else:
        checkpoints = step_dirs(target) or step_dirs(target / "checkpoints")
    if not checkpoints:
        raise FileNotFoundError(f"no checkpoint at {target} (looked for a checkpoint, and for step-N directories in "
                                f"it and in its checkpoints/)")
    damaged = 0
    for path in checkpoints:
        problems = verify_checkpoint(path, args.level)
        damaged += bool(problems)
        print(f"{path}: {'DAMAGED' if problems else 'intact'}" + "".join(f"\n  {p}" for p in problems))
    print(f"{len(checkpoints)} checkpoint(s) checked ({args.level}): {len(checkpoints) - damaged} intact, "
          f"{damaged} damaged")
    if damaged:
        sys.exit(exit_codes.CHECK_FAILED)


def add_plot(sub, name: str) -> None:
    p = sub.add_parser(name, help="write the loss curve of a job as PNG")
    p.add_argument("job", help="a job directory")
    p.add_argument("--out", help="output path (default: <job>/loss.png)")


def run_plot(args) -> None:
    from pathlib import Path

    from maester.tools.plot import plot_loss

    print(plot_loss(Path(args.job), Path(args.out) if args.out else None))


def add_report(sub, name: str) -> None:
    p = sub.add_parser(name, help="draw a job's dashboard (loss, validation loss, LR, grad norm, tokens/s, MFU) "
                                      "as PNG and print a summary of where it stands; works while it trains")
    p.add_argument("job", help="a job directory")
    p.add_argument("--out", help="the PNG (default: <job>/report.png); the summary is written beside it as .txt")


def run_report(args) -> None:
    from pathlib import Path

    from maester.tools.report import write_report

    report = write_report(Path(args.job), Path(args.out) if args.out else None)
    print(report.summary)
    print(f"wrote {report.png} and {report.text}")
