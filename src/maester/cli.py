"""The `maester` command. Subcommands parse their arguments, then import what they need (torch only there)."""

from __future__ import annotations

import argparse
import os
import sys

OVERRIDES_HELP = "then any number of config overrides: --section.key=value or --section.key value"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maester", description="Train large language models with PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train from a config file or a job directory (resumes automatically)",
                       epilog=OVERRIDES_HELP + ". Exit codes: 0 trained to training.steps (or already had: the job's "
                              "COMPLETED marker covers them); 2 a config or input error; 3 stopped on SIGTERM, "
                              "SIGUSR1 or <job>/stop-requested after saving a checkpoint (<job>/requeue-requested "
                              "written): run it again to resume.")
    p.add_argument("target", help="a config file (TOML/YAML/JSON) or a job directory jobs/<name>")

    p = sub.add_parser("seed-checkpoint", epilog=OVERRIDES_HELP,
                       help="initialise the model on one process and save it as the job's step-0 checkpoint")
    p.add_argument("target", help="a config file or a job directory")

    p = sub.add_parser("submit", help="create the job directory jobs/<name> for a config and sbatch its slurm.sh",
                       epilog=OVERRIDES_HELP)
    p.add_argument("config", help="a config file (TOML/YAML/JSON)")
    p.add_argument("--name", help="job name (default: job.name from the config)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the script, write nothing")
    p.add_argument("--no-submit", action="store_true", help="write the job directory, do not call sbatch")
    p.add_argument("--chain", type=int, default=1, metavar="K",
                   help="submit K jobs, each starting when the previous ends (afterany): runs longer than the walltime")
    p.add_argument("--after", metavar="JOBID", help="the first job waits for this SLURM job to end")

    p = sub.add_parser("sweep", help="a grid of jobs: submit, status, cancel, retry, report")
    ssub = p.add_subparsers(dest="sweep_command", required=True, metavar="ACTION")
    q = ssub.add_parser("submit", help="one job directory per point under <dump_dir>/<sweep name>/, each submitted",
                        epilog=OVERRIDES_HELP)
    q.add_argument("sweep", help="a sweep file (TOML/YAML/JSON): name, base, mode, fixed, parameters")
    q.add_argument("--no-submit", action="store_true", help="write the job directories, do not call sbatch")
    for action, text in (("status", "a table: job, SLURM state, last step, last loss"),
                         ("cancel", "scancel the points still queued or running"),
                         ("retry", "submit again the points that failed or were cancelled"),
                         ("run", "train the points not yet completed here, one after another, without SLURM"),
                         ("report", "write report.csv and report.png in the sweep directory")):
        q = ssub.add_parser(action, help=text)
        q.add_argument("dir", help="the sweep directory (<dump_dir>/<sweep name>)")
    q.add_argument("--transfer", action="store_true",
                   help="also transfer.png: final loss against LR, a line per width (μP LR transfer)")
    q.add_argument("--lr-key", default="optimizer.lr", help="the LR parameter for --transfer (default optimizer.lr)")
    q.add_argument("--width-key", default="model.width",
                   help="the width parameter for --transfer (default model.width)")

    p = sub.add_parser("mup", help="μP tools: the coordinate check")
    msub = p.add_subparsers(dest="mup_command", required=True, metavar="ACTION")
    q = msub.add_parser("coord-check", epilog=OVERRIDES_HELP,
                        help="train the config's model at several widths a few steps on one batch and plot the "
                             "mean |activation| of embedding, attention, MLP and logits against width")
    q.add_argument("config", help="a config file (its model, optimizer, mup and data sections are used)")
    q.add_argument("--widths", required=True, help="comma-separated model widths, e.g. 64,128,256,512,1024")
    q.add_argument("--steps", type=int, default=3, help="training steps per width (default 3)")
    q.add_argument("--seeds", type=int, default=1, help="seeds per width, averaged (default 1)")
    q.add_argument("--out", help="output directory (default <job dir>/coord-check-mup or -sp)")

    p = sub.add_parser("launch", help="run a job directory here under torchrun, logging as a SLURM job would")
    p.add_argument("job", help="a job directory")
    p.add_argument("--nproc", type=int, default=1, help="processes (default 1)")

    p = sub.add_parser("config", help="inspect configs")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the resolved config tree", epilog=OVERRIDES_HELP)
    show.add_argument("config", help="a config file or a job directory")
    show.add_argument("--format", choices=("json", "yaml"), default="json")

    p = sub.add_parser("generate", help="sample text from a job's latest checkpoint, a checkpoint directory or a "
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

    p = sub.add_parser("convert", help="convert between Hugging Face model directories and maester checkpoints")
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

    p = sub.add_parser("checkpoint", help="checkpoint tools: verify")
    ksub = p.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    q = ksub.add_parser("verify", help="check checkpoints against their manifests (every file's size and CRC-32); "
                                       "exit 0 when all are intact, 1 when one is damaged")
    q.add_argument("target", help="a job directory, its checkpoints/ directory or one checkpoint")
    q.add_argument("--level", choices=("size", "full"), default="full",
                   help="size: compare file sizes only; full (default): also read every file for its CRC-32")

    p = sub.add_parser("plot", help="write the loss curve of a job as PNG")
    p.add_argument("job", help="a job directory")
    p.add_argument("--out", help="output path (default: <job>/loss.png)")

    p = sub.add_parser("report", help="draw a job's dashboard (loss, validation loss, LR, grad norm, tokens/s, MFU) "
                                      "as PNG and print a summary of where it stands; works while it trains")
    p.add_argument("job", help="a job directory")
    p.add_argument("--out", help="the PNG (default: <job>/report.png); the summary is written beside it as .txt")

    p = sub.add_parser("preflight", epilog=OVERRIDES_HELP,
                       help="check all-reduce, all-gather and reduce-scatter results and bandwidth on the job's "
                            "processes (run it under torchrun or srun as the job runs); writes <job>/preflight.json")
    p.add_argument("target", help="a job directory or a config file")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop at the first wrong result and exit with status 1 (a timeout always does); the "
                        "config's preflight.fail_fast applies to the check before training")
    p.add_argument("--sizes", nargs="+", metavar="SIZE",
                   help="buffer sizes in bytes, e.g. 4096 64K 32MiB 1G (default: preflight.sizes)")
    p.add_argument("--dtypes", nargs="+", metavar="DTYPE", choices=("float32", "bfloat16", "float16"),
                   help="float32, bfloat16, float16 (default: preflight.dtypes)")

    _data_parser(sub)
    return parser


INPUTS_HELP = "files, directories or globs of .jsonl, .jsonl.gz, .jsonl.zst or .parquet documents"


def _data_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare data: tokenize, merge, inspect, count, convert, pack",
                       description="Prepare training data. Each action prints one summary line at the end.")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    t = dsub.add_parser("tokenize", help="tokenize documents into an indexed dataset (.bin/.idx) or token Parquet")
    t.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUTS_HELP)
    t.add_argument("--output-prefix", required=True, metavar="OUT",
                   help="writes OUT_text_document.bin/.idx (OUT_<text-key>_document, as GPT-NeoX names it), or "
                        "OUT.parquet with --format parquet")
    t.add_argument("--format", choices=("indexed", "parquet"), default="indexed",
                   help="indexed: Megatron/GPT-NeoX .bin/.idx; parquet: an input_ids list<int32> column")
    _tokenizer_args(t, required=True)
    _encoding_args(t)
    _record_args(t)

    m = dsub.add_parser("merge", help="concatenate indexed datasets of one dtype into one")
    m.add_argument("prefixes", nargs="+", metavar="PREFIX",
                   help="indexed datasets: a prefix, its .bin/.idx, or the --output-prefix given to tokenize")
    m.add_argument("--output-prefix", required=True, metavar="OUT", help="writes OUT.bin and OUT.idx")

    i = dsub.add_parser("inspect", help="show the first documents as text and as a table of token ids and pieces")
    i.add_argument("path", help="an indexed dataset prefix, a token Parquet file, or raw JSONL/Parquet text "
                                "(raw text needs --tokenizer)")
    i.add_argument("-n", type=int, default=5, metavar="N", help="how many documents (default: 5)")
    i.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="rows of each token table (default: 64; 0: all)")
    i.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSON field or Parquet column of the text (default: text)")
    _tokenizer_args(i, required=False)

    c = dsub.add_parser("count", help="count the tokens of every document")
    c.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUTS_HELP)
    c.add_argument("--output", help="write the count of each document there, one number per line")
    _tokenizer_args(c, required=True)
    _encoding_args(c)
    _record_args(c)

    v = dsub.add_parser("convert", help="convert JSONL <-> Parquet shards of about a target size")
    v.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUTS_HELP)
    v.add_argument("--output-dir", required=True, help="writes part-00000.<format>, part-00001.<format>, ...")
    v.add_argument("--to", required=True, choices=("parquet", "jsonl"))
    v.add_argument("--shard-size-mb", type=float, default=256.0, metavar="MB",
                   help="close a shard once it holds this much data (uncompressed text for Parquet; default: 256)")
    v.add_argument("--messages-key", default="messages", metavar="KEY",
                   help="the field of a conversation's [{role, content}] list (default: messages)")
    _record_args(v)

    k = dsub.add_parser("pack", help="encode conversations with a chat template and pack them whole into rows of "
                                     "--seq-len tokens (best-fit decreasing), as Parquet")
    k.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUTS_HELP)
    k.add_argument("--output", required=True, metavar="DIR", help="writes DIR/part-00000.parquet, ...")
    k.add_argument("--seq-len", type=int, required=True, metavar="N", help="tokens per row")
    _tokenizer_args(k, required=True)
    k.add_argument("--template", default="chatml", metavar="T",
                   help="chatml, llama3, gemma, jinja (the chat_template of tokenizer_config.json) or markers "
                        "(default: chatml)")
    k.add_argument("--chat-template", metavar="PATH",
                   help="--template jinja: a tokenizer_config.json or its directory (default: the one beside "
                        "--tokenizer)")
    k.add_argument("--mask", default="assistant_only", metavar="M",
                   help="the tokens trained: assistant_only, all or last_assistant_only (default: assistant_only)")
    k.add_argument("--seed", type=int, default=0, help="orders equal lengths and the rows (default: 0)")
    k.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                   help="a conversation longer than --seq-len is cut to fit or left out (default: truncate)")
    k.add_argument("--messages-key", default="messages", metavar="KEY",
                   help="the field of a conversation's [{role, content}] list (default: messages)")
    k.add_argument("--system-prompt", metavar="TEXT", help="a system message for conversations that have none")
    k.add_argument("--workers", type=int, default=1, metavar="N",
                   help="encoding processes (default: 1); the output does not depend on it")
    k.add_argument("--rows-per-file", type=int, default=8192, metavar="N",
                   help="rows per output file (default: 8192)")
    _record_args(k)


def _tokenizer_args(p, required: bool) -> None:
    p.add_argument("--tokenizer", required=required, metavar="SPEC",
                   help="byte; a tokenizer.json or its directory; a SentencePiece .model; a tiktoken rank file "
                        "(KIND:PATH names the kind: hf, sentencepiece, tiktoken)")
    p.add_argument("--bos-token", metavar="TOKEN", help="the BOS token's text (default: the tokenizer's own)")
    p.add_argument("--eos-token", metavar="TOKEN", help="the EOS token's text (default: the tokenizer's own)")
    p.add_argument("--special-tokens", nargs="+", action="extend", default=[], metavar="TOKEN=ID",
                   help="tiktoken only: special tokens after the ranks")
    p.add_argument("--control-tokens", nargs="+", action="extend", default=[], metavar="MARKER=TOKEN",
                   help="markers in the text that become a special token's id, e.g. '<<<|user|>>>=<|user|>'")


def _encoding_args(p) -> None:
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="tokenizer processes (default: 1); the output does not depend on it")
    p.add_argument("--append-eod", action="store_true", help="append the tokenizer's EOS id to each document")
    p.add_argument("--add-bos", action="store_true", help="put the tokenizer's BOS id before each document")
    p.add_argument("--chunk-size", type=int, default=1000, metavar="N",
                   help="documents per encode_batch call (default: 1000)")


def _record_args(p) -> None:
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSON field or Parquet column of the text (default: text)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip invalid records (counted by reason in the summary) instead of stopping at the first")


TAKES_OVERRIDES = {"train", "seed-checkpoint", "submit", "config", "sweep", "preflight", "mup"}


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in TAKES_OVERRIDES:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    from maester.config import ConfigError

    try:
        COMMANDS[args.command](args)
    except (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError,
            ValueError) as e:
        print(f"maester {args.command}: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print(f"maester {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        code, advice = _training_failure(e)
        if code is None:
            raise
        print(f"maester {args.command}: error: {e}\n{advice}", file=sys.stderr)
        sys.exit(code)


EXIT_BAD_INPUT = 2
"""A bad config, file or argument; `maester.train.preemption.REQUEUE_EXIT_CODE` (3) is a stop for a requeue."""
EXIT_NONFINITE, EXIT_OUT_OF_MEMORY, EXIT_COLLECTIVE = 4, 5, 6
GLOO_COLLECTIVE_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer")


def _training_failure(e: Exception) -> tuple[int | None, str]:
    """The exit code and advice for a failure a run's settings can cause; (None, "") for anything else (a bug:
    its traceback is shown)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, ""
    from maester.train.nonfinite import NonFiniteError

    if isinstance(e, NonFiniteError):
        return EXIT_NONFINITE, ("lower optimizer.lr, raise schedule.warmup_steps or set training.max_grad_norm, "
                                "then resume from the latest checkpoint; training.detect_anomaly = true names the "
                                "op that made the first NaN, and training.nonfinite = 'skip' steps over rare ones")
    if isinstance(e, torch.OutOfMemoryError):
        return EXIT_OUT_OF_MEMORY, ("out of device memory: lower training.micro_batch_size, set "
                                    "parallel.activation_checkpointing, or shard more (parallel.dp_shard); "
                                    "profiling.memory_snapshot = true records where the memory went")
    if isinstance(e, torch.distributed.DistError) or (  # gloo raises plain RuntimeErrors
            isinstance(e, RuntimeError) and any(m in str(e) for m in GLOO_COLLECTIVE_FAILURES)):
        return EXIT_COLLECTIVE, ("a collective failed or timed out: another rank died or hung (its log says why; "
                                 "logging.per_rank_files = true keeps one per rank), or the network failed; "
                                 "training.train_timeout_seconds bounds the wait")
    return None, ""


def _train(args) -> None:
    from maester.jobs.job_dir import config_for_target, is_job_dir, lock_job_dir, write_job_dir
    from maester.train.preemption import COMPLETED_FILE, REQUEUE_EXIT_CODE, REQUEUE_FILE, completed_marker

    rank = int(os.environ.get("RANK", "0"))
    # A job whose COMPLETED marker covers training.steps (a later link of a chain) has nothing to do: it exits
    # before torch is imported and leaves the job directory as it is.
    cfg, job_dir = config_for_target(args.target, args.overrides)
    done = completed_marker(job_dir, cfg.training.steps)
    if done is not None:
        if rank == 0:
            print(f"{job_dir / COMPLETED_FILE}: training completed at step {done['step']} (training.steps = "
                  f"{cfg.training.steps}): nothing to do", file=sys.stderr)
        return

    import torch.distributed as dist

    from maester.train.trainer import Trainer, setup_logging

    setup_logging(None, rank)  # so that write_job_dir reports what the overrides change
    lock, existing = None, is_job_dir(job_dir)
    if rank == 0:
        lock = lock_job_dir(job_dir, cfg.training.requeue_lock_wait_seconds)
        if not existing:
            write_job_dir(cfg, job_dir)
    try:
        trainer = Trainer(cfg, job_dir)
        if rank == 0 and existing:  # an override that fails the resume is not kept in config.json
            write_job_dir(cfg, job_dir)
        result = trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()
    if result.stop_reason is not None:
        if rank == 0:
            print(f"stopped on request ({result.stop_reason}) at step {result.step}; checkpoint {result.checkpoint}; "
                  f"wrote {job_dir / REQUEUE_FILE}; exiting with code {REQUEUE_EXIT_CODE} for a requeue")
        sys.exit(REQUEUE_EXIT_CODE)
    if rank == 0:
        print(f"trained to step {result.step}; job directory {job_dir}"
              + (f"; checkpoint {result.checkpoint}" if result.checkpoint else ""))


def _mup(args) -> None:
    from pathlib import Path

    from maester.config import load_config
    from maester.tools.coord_check import run
    from maester.train.trainer import setup_logging

    setup_logging()
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise ValueError(f"--widths {args.widths!r}: give comma-separated integers, e.g. 64,128,256") from None
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else cfg.job_dir / ("coord-check-mup" if cfg.mup.enabled else "coord-check-sp")
    csv_path, png_path, spread = run(cfg, widths, args.steps, args.seeds, out)
    print(f"wrote {csv_path} and {png_path}")
    print(f"largest / smallest mean |activation| across widths {widths[0]}..{widths[-1]} at step {args.steps}: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in spread.items()))


def _seed_checkpoint(args) -> None:
    from maester.jobs.job_dir import config_for_target, write_job_dir
    from maester.train.trainer import write_seed_checkpoint

    cfg, job_dir = config_for_target(args.target, args.overrides)
    write_job_dir(cfg, job_dir)
    print(f"seed checkpoint {write_seed_checkpoint(cfg, job_dir)}")


def _submit(args) -> None:
    from maester.config import load_config
    from maester.jobs.job_dir import write_job_dir
    from maester.jobs.slurm import SubmitError, check_inputs, render_slurm_script, submit_job

    overrides = list(args.overrides) + ([f"--job.name={args.name}"] if args.name else [])
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        print(cfg.to_json(), end="")
        print(f"# dry run: would write {cfg.job_dir}/config.json, slurm.sh, logs/, checkpoints/", file=sys.stderr)
        print(render_slurm_script(cfg, cfg.job_dir), end="", file=sys.stderr)
        return
    render_slurm_script(cfg, cfg.job_dir)  # template errors before anything is written
    problems = check_inputs(cfg)
    if problems:
        raise SubmitError("the job would fail on the cluster:\n  " + "\n  ".join(problems))
    job_dir = write_job_dir(cfg)
    if args.no_submit:
        print(f"job directory {job_dir}: run with `maester train {job_dir}`, `maester launch {job_dir}` or "
              f"`sbatch {job_dir}/slurm.sh`")
        return
    ids = submit_job(job_dir, chain=args.chain, after=args.after)
    print(f"job directory {job_dir}: submitted SLURM job{'s' if len(ids) > 1 else ''} {' -> '.join(ids)}")


def _sweep(args) -> None:
    from pathlib import Path

    from maester.jobs import sweep

    if args.sweep_command == "submit":
        root = sweep.submit_sweep(Path(args.sweep), list(args.overrides), no_submit=args.no_submit)
        points = sweep.load_sweep(root)["points"]
        print(f"sweep {root}: {len(points)} points {'written' if args.no_submit else 'submitted'}")
        return
    if args.overrides:
        raise ValueError(f"maester sweep {args.sweep_command} takes no overrides: {' '.join(args.overrides)}")
    root = Path(args.dir)
    if args.sweep_command == "status":
        print(sweep.format_status(sweep.status(root)))
    elif args.sweep_command == "cancel":
        ids = sweep.cancel(root)
        print(f"cancelled {' '.join(ids)}" if ids else "nothing queued or running")
    elif args.sweep_command == "retry":
        names = sweep.retry(root)
        print(f"resubmitted {' '.join(names)}" if names else "no failed or cancelled points")
    elif args.sweep_command == "run":
        names = sweep.run_here(root)
        print(f"trained {' '.join(names)}" if names else "every point has completed")
    else:
        csv_path, png_path = sweep.report(root)
        print(f"{csv_path}\n{png_path}")
        if args.transfer:
            path, best = sweep.transfer_plot(root, sweep.status(root), args.lr_key, args.width_key)
            print(path)
            for panel, lrs in best.items():
                print(f"{panel}: best {args.lr_key} per width: "
                      + ", ".join(f"{w}: {lr:.3g}" for w, lr in sorted(lrs.items())))


def _launch(args) -> None:
    from pathlib import Path

    from maester.jobs.launch import launch_local

    sys.exit(launch_local(Path(args.job), args.nproc))


def _config(args) -> None:
    from maester.jobs.job_dir import config_for_target

    cfg, _ = config_for_target(args.config, args.overrides)
    if args.format == "yaml":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    else:
        print(cfg.to_json(), end="")


def _generate(args) -> None:
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


def _convert(args) -> None:
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


def _checkpoint(args) -> None:
    from pathlib import Path

    from maester.train.checkpoint import step_dirs, verify_checkpoint

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
        sys.exit(1)


def _plot(args) -> None:
    from pathlib import Path

    from maester.tools.plot import plot_loss

    print(plot_loss(Path(args.job), Path(args.out) if args.out else None))


def _report(args) -> None:
    from pathlib import Path

    from maester.tools.report import write_report

    report = write_report(Path(args.job), Path(args.out) if args.out else None)
    print(report.summary)
    print(f"wrote {report.png} and {report.text}")


def _preflight(args) -> None:
    import json

    import torch.distributed as dist

    from maester.jobs.job_dir import config_for_target
    from maester.parallel.preflight import PreflightFailed, parse_size, run_preflight
    from maester.parallel.dims import init_distributed

    overrides = list(args.overrides)
    if args.sizes:
        overrides.append(f"--preflight.sizes={json.dumps([parse_size(s) for s in args.sizes])}")
    if args.dtypes:
        overrides.append(f"--preflight.dtypes={json.dumps(args.dtypes)}")
    cfg, job_dir = config_for_target(args.target, overrides)
    rank, _, device = init_distributed(cfg.training.device, precision=cfg.training.precision)
    try:
        report = run_preflight(cfg.preflight, job_dir, device, fail_fast=args.fail_fast)
    except PreflightFailed as e:
        if rank == 0:
            print(f"maester preflight: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not report.ok and rank == 0:
        print("maester preflight: some collectives gave WRONG results (see the table); without --fail-fast the "
              "status is 0", file=sys.stderr)


def _data_tokenizer(args):
    from maester.tools.data_tokenize import parse_pairs, parse_special_tokens, tokenizer_config

    if args.tokenizer is None:
        return None
    return tokenizer_config(args.tokenizer, bos_token=args.bos_token, eos_token=args.eos_token,
                            special_tokens=parse_special_tokens(args.special_tokens),
                            control_tokens=parse_pairs(args.control_tokens, "--control-tokens", "MARKER=TOKEN"))


def _terminated(signum, frame) -> None:
    """SIGTERM in a data tool: unwind like Ctrl-C, so that its temporary files are removed on the way out."""
    raise KeyboardInterrupt


def _data(args) -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    action = args.data_command
    if action == "tokenize":
        from maester.tools.data_tokenize import tokenize

        summary = tokenize(args.inputs, args.output_prefix, _data_tokenizer(args), workers=args.workers,
                           append_eod=args.append_eod, add_bos=args.add_bos, text_key=args.text_key,
                           fmt=args.format, skip_invalid=args.skip_invalid, chunk_size=args.chunk_size)
    elif action == "count":
        from maester.tools.data_tokenize import count

        summary = count(args.inputs, _data_tokenizer(args), output=args.output, workers=args.workers,
                        append_eod=args.append_eod, add_bos=args.add_bos, text_key=args.text_key,
                        skip_invalid=args.skip_invalid, chunk_size=args.chunk_size)
    elif action == "merge":
        from maester.tools.data_merge import merge

        summary = merge(args.prefixes, args.output_prefix)
    elif action == "inspect":
        from maester.tools.data_inspect import inspect

        summary = inspect(args.path, args.n, _data_tokenizer(args), text_key=args.text_key,
                          max_tokens=args.max_tokens)
    elif action == "pack":
        from maester.tools.data_pack import pack

        summary = pack(args.inputs, args.output, _data_tokenizer(args), seq_len=args.seq_len, template=args.template,
                       mask=args.mask, seed=args.seed, overlong=args.overlong, messages_key=args.messages_key,
                       text_key=args.text_key, system_prompt=args.system_prompt, chat_template=args.chat_template,
                       skip_invalid=args.skip_invalid, workers=args.workers, rows_per_file=args.rows_per_file)
    else:
        from maester.tools.data_convert import convert

        summary = convert(args.inputs, args.output_dir, args.to, shard_size_mb=args.shard_size_mb,
                          text_key=args.text_key, messages_key=args.messages_key, skip_invalid=args.skip_invalid)
    print(summary.line())


COMMANDS = {"train": _train, "seed-checkpoint": _seed_checkpoint, "submit": _submit, "config": _config,
            "preflight": _preflight,
            "generate": _generate, "launch": _launch, "sweep": _sweep, "mup": _mup, "convert": _convert,
            "checkpoint": _checkpoint, "plot": _plot, "report": _report, "data": _data}
