"""The commands on checkpoints and models: generate, eval, convert, verify, plot, report. Each is an `add_*` (its
arguments) and a `run_*` (what it does, importing torch only there)."""

from __future__ import annotations

import sys

from maester import exit_codes


def add_model_options(p) -> None:
    """The options of generate and chat that say where the model runs and how it samples."""
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of tokens holding this "
                                                             "share of the probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="auto (default): the GPU where torch can use one, else the CPU; a GPU asked for and "
                        "unusable is an error. Under torchrun each process takes the GPU of its LOCAL_RANK")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="the dtype the weights are loaded and run in (auto: bfloat16 on a GPU, float32 on the CPU)")


def add_generate(sub, name: str) -> None:
    p = sub.add_parser(name, help="sample text from a job's latest checkpoint, a checkpoint directory or a "
                                  "Hugging Face model directory (tensor parallel under torchrun)")
    p.add_argument("target", help="a job directory, a checkpoint directory, or an HF model directory (config.json, "
                                  "safetensors, tokenizer.json)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompts-file", metavar="FILE",
                        help="a smoke suite: one prompt per line, or (.jsonl) one {\"prompt\": ...} or "
                             "{\"messages\": [...]} per line; each result is printed under its prompt")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts of --prompts-file decoded together, left-padded (default: 8); the same tokens as "
                        "one at a time")
    add_model_options(p)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message in the chat template (the job's data.sft, or an HF "
                        "directory's own chat_template) and print the assistant's answer, up to its end of turn")


def load_completer(args, chat: bool, needs_template: bool):
    """The model of `args.target` on this process's device and dtype (sharded over the processes of torchrun) in a
    Completer with the sampling options (`chat`: text prompts are sent as user messages; `needs_template`: some
    prompt is answered in the chat template); returns it and this process's rank. Rank 0 says which checkpoint (or
    HF model) it read, on stderr."""
    from maester.tools.generate import Completer, read_for_inference, start_inference
    from maester.tools.hf_dir import is_hf_model_dir
    from maester.models.sampling import check_sampling

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)  # before loading
    device, dtype, tp_mesh, rank = start_inference(args.device, args.dtype)
    loaded = read_for_inference(args.target, device, dtype, tp_mesh)
    if rank == 0:
        print(f"sampling from {loaded.describe()}", file=sys.stderr, flush=True)
    if needs_template and is_hf_model_dir(args.target) and loaded.cfg.data.sft.template != "jinja":
        raise ValueError(f"{args.target}: chat uses the model's chat template, but its tokenizer_config.json has no "
                         f"chat_template (and there is no chat_template.jinja)")
    completer = Completer(loaded.model, loaded.tokenizer, loaded.cfg, chat=chat, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return completer, rank


def run_generate(args) -> None:
    from maester.tools.generate import Prompt, read_prompts

    prompts = read_prompts(args.prompts_file) if args.prompts_file else [Prompt("--prompt", text=args.prompt)]
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    completer, rank = load_completer(args, args.chat, args.chat or any(p.messages is not None for p in prompts))
    try:
        if not args.prompts_file:  # one prompt: its text as it is generated, as chat shows it
            write = _to_stdout if rank == 0 else (lambda text: None)
            write(args.prompt if not args.chat else "")
            completer.stream(prompts[0], write)
            write("\n")
            return
        outs = completer.complete_batch(prompts, args.batch_size)
        if rank == 0:
            print_results(prompts, outs)
    finally:
        _leave_process_group()


def _to_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def print_results(prompts, outs: list[str]) -> None:
    """Each result of a prompts file under its prompt."""
    for prompt, out in zip(prompts, outs):
        shown = ([f"{m['role']}: {m['content']}" for m in prompt.messages] if prompt.messages is not None
                 else [prompt.text])
        print(f"### {prompt.where}")
        print("\n".join("> " + line for text in shown for line in text.split("\n")))
        print(out, end="\n\n", flush=True)


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def add_chat(sub, name: str) -> None:
    p = sub.add_parser(name, help="talk with a model: the conversation is kept, answers stream as they are "
                                  "generated; /reset, /system TEXT, /quit")
    p.add_argument("target", help="a job directory, a checkpoint directory, or an HF model directory with a chat "
                                  "template")
    p.add_argument("--system", metavar="TEXT", help="the system prompt (default: the job's data.sft.system_prompt)")
    add_model_options(p)


def run_chat(args) -> None:
    from maester.tools.chat import ChatSession, run_session

    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("chat reads one terminal: run it as one process, without torchrun (tensor-parallel "
                         "generation is `torchrun ... -m maester generate`)")
    completer, _ = load_completer(args, chat=True, needs_template=True)
    run_session(ChatSession(completer, args.system), input, sys.stdout)


def add_eval(sub, name: str) -> None:
    p = sub.add_parser(name, help="run lm-evaluation-harness tasks on a job's latest checkpoint or a checkpoint "
                                  "(data parallel under torchrun); needs the `eval` extra")
    p.add_argument("target", nargs="?", help="a job directory, a checkpoint directory, or an HF model directory")
    p.add_argument("--tasks", required=True, metavar="T1,T2",
                   help="lm-eval task, group or tag names, or task YAML files (path ending in .yaml); the shipped "
                        "offline tasks are pydoc_choice and pydoc_complete")
    p.add_argument("--limit", default=None, metavar="N",
                   help="at most N documents per task (below 1: that share of them)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward on each process (default: 8)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                   help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--output", metavar="FILE", help="write lm-eval's results as JSON to FILE")
    p.add_argument("--log-samples", action="store_true",
                   help="put every document's requests and responses into the JSON (`samples`)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a directory of task YAMLs whose names --tasks may use (repeatable)")
    p.add_argument("--download-only", action="store_true",
                   help="load the tasks' data (into the Hugging Face cache) and stop, without a model: run it where "
                        "there is internet for nodes without; with HF_DATASETS_OFFLINE=1 it checks the cache")
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="auto (default): the GPU where torch can use one, else the CPU; under torchrun each process "
                        "takes the GPU of its LOCAL_RANK")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="the dtype the weights are loaded and run in (auto: bfloat16 on a GPU, float32 on the CPU)")


def eval_limit(text: str | None) -> int | float | None:
    """`--limit`: a number of documents, or a share of them below 1."""
    import math

    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--limit {text!r}: expected a positive number of documents (or a share of them below 1)")
    return int(value) if value >= 1 and value == int(value) else value


def run_eval(args) -> None:
    from maester.tools.evaluate import download_tasks, evaluate_target, require_lm_eval

    require_lm_eval()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks names no task")
    if args.download_only:
        print("\n".join(download_tasks(tasks, args.include_path)))
        return
    if args.target is None:
        raise ValueError("give the job, checkpoint or HF model directory to evaluate (or --download-only)")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: give 0 or more few-shot examples")
    limit = eval_limit(args.limit)
    try:
        results = evaluate_target(args.target, tasks, limit=limit, batch_size=args.batch_size,
                                  num_fewshot=args.num_fewshot, output=args.output, device=args.device,
                                  dtype=args.dtype, include_paths=args.include_path, log_samples=args.log_samples)
        if results is not None:
            from maester.evaluation.harness import results_table

            print(results_table(results))
            if args.output:
                print(f"wrote {args.output}")
    finally:
        _leave_process_group()


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
    t.add_argument("--revision", metavar="BRANCH",
                   help="with --upload: upload to this branch (created from main if absent), e.g. step-400")
    t.add_argument("--base-model", metavar="ORG/NAME",
                   help="the Hub model this one was trained from, recorded in the model card (README.md)")


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
                tokenizer=not args.no_tokenizer, upload=args.upload, revision=args.revision, base_model=args.base_model)
    where = f"{args.upload}" + (f" (branch {args.revision})" if args.revision else "")
    print(f"wrote the Hugging Face model directory {out}" + (f"; uploaded to {where}" if args.upload else ""))


def add_checkpoint(sub, name: str) -> None:
    p = sub.add_parser(name, help="checkpoint tools: verify")
    ksub = p.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    q = ksub.add_parser("verify", help="check checkpoints against their manifests (every file's size and checksum); "
                                       "exit 0 when none is damaged, 1 when one is")
    q.add_argument("target", help="a job directory, its checkpoints/ directory or one checkpoint")
    q.add_argument("--level", choices=("size", "full"), default="full",
                   help="size: compare file sizes only; full (default): also read every file for its checksum")


def run_checkpoint(args) -> None:
    from pathlib import Path

    from maester.train.checkpoint_files import step_dirs, unverified, verify_checkpoint

    target = Path(args.target)
    if (target / ".metadata").is_file() or (target / "manifest.json").is_file():
        checkpoints = [target]
    else:
        checkpoints = step_dirs(target) or step_dirs(target / "checkpoints")
    if not checkpoints:
        raise FileNotFoundError(f"no checkpoint at {target} (looked for a checkpoint, and for step-N directories in "
                                f"it and in its checkpoints/)")
    damaged = unchecked = 0
    for path in checkpoints:
        problems = verify_checkpoint(path, args.level)
        old = not problems and unverified(path)
        damaged, unchecked = damaged + bool(problems), unchecked + old
        verdict = "DAMAGED" if problems else ("unverified: no manifest (written before manifests existed); only its "
                                              ".metadata and trainer_state.json were checked" if old else "intact")
        print(f"{path}: {verdict}" + "".join(f"\n  {p}" for p in problems))
    print(f"{len(checkpoints)} checkpoint(s) checked ({args.level}): {len(checkpoints) - damaged - unchecked} intact, "
          f"{damaged} damaged" + (f", {unchecked} unverified" if unchecked else ""))
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


def add_status(sub, name: str) -> None:
    p = sub.add_parser(name, help="where a submitted job stands: SLURM state (squeue, sacct), step, loss, time "
                                  "left, restarts after failures, post-processing")
    p.add_argument("job", help="a job directory")


def run_status(args) -> None:
    from pathlib import Path

    from maester.tools.job_status import format_status, status_items

    print(format_status(Path(args.job), status_items(Path(args.job))))


def add_cancel(sub, name: str) -> None:
    p = sub.add_parser(name, help="scancel a job's SLURM jobs still queued or running (chain links, restarts, "
                                  "post-processing); the trainer saves a checkpoint on the way out")
    p.add_argument("job", help="a job directory")


def run_cancel(args) -> None:
    from pathlib import Path

    from maester.tools.job_status import cancel

    ids = cancel(Path(args.job))
    print(f"cancelled {' '.join(ids)}" if ids else "nothing queued or running")
