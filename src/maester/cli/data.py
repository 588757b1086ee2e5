"""`maester data`: tokenize, merge, inspect, count, convert, pack and download. SIGTERM unwinds like Ctrl-C, so that a
stopped tool leaves no temporary file."""

from __future__ import annotations


INPUTS_HELP = "files, directories or globs of .jsonl, .jsonl.gz, .jsonl.zst, .parquet or .txt documents"


def add_data(sub, name: str) -> None:
    p = sub.add_parser(name, help="prepare data: tokenize, merge, inspect, count, convert, pack, download",
                       description="Prepare training data. Each action prints one summary line at the end.")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    t = dsub.add_parser("tokenize", help="tokenize documents into an indexed dataset (.bin/.idx) or token Parquet")
    t.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUTS_HELP)
    t.add_argument("--output-prefix", required=True, metavar="OUT",
                   help="writes OUT_text_document.bin/.idx (OUT_<text-key>_document, as GPT-NeoX names it), or "
                        "OUT.parquet with --format parquet; with --template also OUT_label_document.bin/.idx")
    t.add_argument("--format", choices=("indexed", "parquet"), default="indexed",
                   help="indexed: Megatron/GPT-NeoX .bin/.idx; parquet: an input_ids list<int32> column")
    _tokenizer_args(t, required=True)
    _encoding_args(t)
    _record_args(t)
    _chat_args(t, template_default=None)

    m = dsub.add_parser("merge", help="concatenate indexed datasets of one dtype into one")
    m.add_argument("prefixes", nargs="+", metavar="PREFIX",
                   help="indexed datasets: a prefix, its .bin/.idx, or the --output-prefix given to tokenize")
    m.add_argument("--output-prefix", required=True, metavar="OUT", help="writes OUT.bin and OUT.idx")

    i = dsub.add_parser("inspect", help="show the first documents as text and as a table of token ids and pieces "
                                        "(and labels, beside a label dataset)")
    i.add_argument("path", help="an indexed dataset prefix, a token Parquet file, or raw JSONL/Parquet text "
                                "(raw text needs --tokenizer)")
    i.add_argument("-n", type=int, default=5, metavar="N", help="how many documents (default: 5)")
    i.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="rows of each token table (default: 64; 0: all)")
    i.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSON field or Parquet column of the text (default: text)")
    i.add_argument("--split-on-blank-lines", action="store_true",
                   help=".txt input: each paragraph (lines between blank lines) is a document, not the whole file")
    _tokenizer_args(i, required=False)

    c = dsub.add_parser("count", help="count the tokens of every document, or of every sequence of indexed datasets")
    c.add_argument("inputs", nargs="+", metavar="INPUT",
                   help=INPUTS_HELP + "; or indexed dataset prefixes (counted from their index, no --tokenizer)")
    c.add_argument("--output", help="write the count of each document there, one number per line")
    _tokenizer_args(c, required=False)
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
    _chat_args(k, template_default="chatml")
    k.add_argument("--seed", type=int, default=0, help="orders equal lengths and the rows (default: 0)")
    k.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                   help="a conversation longer than --seq-len is cut to fit or left out (default: truncate)")
    k.add_argument("--workers", type=int, default=1, metavar="N",
                   help="encoding processes (default: 1); the output does not depend on it")
    k.add_argument("--rows-per-file", type=int, default=8192, metavar="N",
                   help="rows per output file (default: 8192)")
    _record_args(k)

    d = dsub.add_parser("download", help="fetch the files of a dataset on the Hugging Face Hub into a directory, "
                                         "for a cluster without internet")
    d.add_argument("source", metavar="SOURCE",
                   help="hf://datasets/org/name[@revision][/<glob or directory>], as a data source spells it")
    d.add_argument("--output", required=True, metavar="DIR",
                   help="writes DIR/<path in the repository> and the manifest DIR/.download.json; must be empty, "
                        "new, or hold this same download")
    d.add_argument("--no-verify", action="store_true",
                   help="when DIR holds this download already, compare file sizes only, not sha256s")


def _chat_args(p, template_default: str | None) -> None:
    """How conversations become tokens and labels: the `data.sft` values."""
    default = f"default: {template_default}" if template_default else "without it, each record is a plain document"
    p.add_argument("--template", default=template_default, metavar="T",
                   help=f"chatml, llama3, gemma, jinja (the chat_template of tokenizer_config.json) or markers "
                        f"({default})")
    p.add_argument("--chat-template", metavar="PATH",
                   help="--template jinja: a tokenizer_config.json or its directory (default: the one beside "
                        "--tokenizer)")
    p.add_argument("--mask", default=None, metavar="M",
                   help="the tokens trained: assistant_only, all or last_assistant_only (default: assistant_only)")
    p.add_argument("--messages-key", default="messages", metavar="KEY",
                   help="the field of a conversation's [{role, content}] list (default: messages)")
    p.add_argument("--system-prompt", metavar="TEXT", help="a system message for conversations that have none")


def _chat(args) -> dict | None:
    """The `data.sft` values of `--template` and its options, None without --template (the others then refused)."""
    if args.template is None:
        given = [o for o, v in (("--mask", args.mask), ("--chat-template", args.chat_template),
                                ("--system-prompt", args.system_prompt)) if v is not None]
        if given:
            raise ValueError(f"{given[0]} applies to conversations: pass --template too")
        return None
    return {"template": args.template, "mask": args.mask or "assistant_only", "messages_key": args.messages_key,
            "system_prompt": args.system_prompt, "chat_template_path": args.chat_template}


def _tokenizer_args(p, required: bool) -> None:
    p.add_argument("--tokenizer", required=required, metavar="SPEC",
                   help="byte; a tokenizer.json or its directory; a SentencePiece .model; a tiktoken rank file "
                        "(KIND:PATH names the kind: hf, sentencepiece, tiktoken)")
    p.add_argument("--bos-token", metavar="TOKEN", help="the BOS token's text (default: the tokenizer's own)")
    p.add_argument("--eos-token", metavar="TOKEN", help="the EOS token's text (default: the tokenizer's own)")
    p.add_argument("--special-tokens", nargs="+", action="extend", default=[], metavar="TOKEN=ID",
                   help="tiktoken only: special tokens after the ranks")
    p.add_argument("--pattern", metavar="REGEX_OR_NAME",
                   help="tiktoken rank files only: the pre-tokenizer regex, or gpt2, r50k_base, p50k_base, "
                        "cl100k_base, llama3 (default: cl100k_base's)")
    p.add_argument("--control-tokens", nargs="+", action="extend", default=[], metavar="MARKER=TOKEN",
                   help="markers in the text that become a special token's id, e.g. '<<<|user|>>>=<|user|>'")


def _encoding_args(p) -> None:
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="tokenizer processes (default: 1); the output does not depend on it")
    p.add_argument("--append-eod", action="store_true", help="append the tokenizer's EOS id to each document")
    p.add_argument("--add-bos", action="store_true", help="put the tokenizer's BOS id before each document")
    p.add_argument("--chunk-size", type=int, default=1000, metavar="N",
                   help="documents per encode_batch call (default: 1000)")
    p.add_argument("--split-on-blank-lines", action="store_true",
                   help=".txt inputs: each paragraph (lines between blank lines) is a document, not the whole file")


def _record_args(p) -> None:
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSON field or Parquet column of the text (default: text)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip invalid records (counted by reason in the summary) instead of stopping at the first")


def _data_tokenizer(args):
    from maester.tools.data_tokenize import parse_pairs, parse_special_tokens, tokenizer_config

    if args.tokenizer is None:
        return None
    return tokenizer_config(args.tokenizer, bos_token=args.bos_token, eos_token=args.eos_token,
                            special_tokens=parse_special_tokens(args.special_tokens), pattern=args.pattern,
                            control_tokens=parse_pairs(args.control_tokens, "--control-tokens", "MARKER=TOKEN"))


def _terminated(signum, frame) -> None:
    """SIGTERM in a data tool: unwind like Ctrl-C, so that its temporary files are removed on the way out."""
    raise KeyboardInterrupt


def run_data(args) -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    action = args.data_command
    if action == "tokenize":
        from maester.tools.data_tokenize import tokenize

        summary = tokenize(args.inputs, args.output_prefix, _data_tokenizer(args), workers=args.workers,
                           append_eod=args.append_eod, add_bos=args.add_bos, text_key=args.text_key,
                           fmt=args.format, skip_invalid=args.skip_invalid, chunk_size=args.chunk_size,
                           split_on_blank_lines=args.split_on_blank_lines, chat=_chat(args))
    elif action == "count":
        from maester.tools.data_tokenize import count

        summary = count(args.inputs, _data_tokenizer(args), output=args.output, workers=args.workers,
                        append_eod=args.append_eod, add_bos=args.add_bos, text_key=args.text_key,
                        skip_invalid=args.skip_invalid, chunk_size=args.chunk_size,
                        split_on_blank_lines=args.split_on_blank_lines)
    elif action == "merge":
        from maester.tools.data_merge import merge

        summary = merge(args.prefixes, args.output_prefix)
    elif action == "inspect":
        from maester.tools.data_inspect import inspect

        summary = inspect(args.path, args.n, _data_tokenizer(args), text_key=args.text_key,
                          max_tokens=args.max_tokens, split_on_blank_lines=args.split_on_blank_lines)
    elif action == "pack":
        from maester.tools.data_pack import pack

        summary = pack(args.inputs, args.output, _data_tokenizer(args), seq_len=args.seq_len, template=args.template,
                       mask=args.mask or "assistant_only", seed=args.seed, overlong=args.overlong, messages_key=args.messages_key,
                       text_key=args.text_key, system_prompt=args.system_prompt, chat_template=args.chat_template,
                       skip_invalid=args.skip_invalid, workers=args.workers, rows_per_file=args.rows_per_file)
    elif action == "download":
        from maester.tools.data_download import download

        summary = download(args.source, args.output, verify=not args.no_verify)
    else:
        from maester.tools.data_convert import convert

        summary = convert(args.inputs, args.output_dir, args.to, shard_size_mb=args.shard_size_mb,
                          text_key=args.text_key, messages_key=args.messages_key, skip_invalid=args.skip_invalid)
    print(summary.line())
