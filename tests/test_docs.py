"""Every `maester ...` command in the fenced blocks of README.md and docs/*.md, run as the docs write it.

Each block is one test (`README.md:76`, ...), found anew on every run: a block that another change adds is picked
up without touching this file. Its commands run one after another from a scratch directory laid out like the
repository root (`configs/` is the repository's own, read only), with the relative paths as written: `uv run`,
`python -m` and a `$ ` prompt are dropped, bash expands the words (quotes, globs, `# comments`), `VAR=value`
prefixes go into the environment, and `maester.cli.main` runs the command in this process (torch is imported
once). A command passes when it exits 0; in a console block (`$ maester ...`) whose next line is
`maester <cmd>: error: ...`, it must exit 2 with that message. The lines after `maester chat` that start with
`you> ` are typed into it.

How a block is marked: one HTML comment per line, right above its opening fence (invisible when rendered):

    <!-- docs-test: tiny -->                  the tiny overrides below (TINY_TRAIN) go after every training
                                              command of the block (train, seed-checkpoint, submit, sweep submit)
    <!-- docs-test: tiny ARGS -->             ARGS go after every maester command of the block (argparse and the
                                              config take the last value: `--workers 1` after `--workers 8`)
    <!-- docs-test: tiny CMD: ARGS -->        ARGS go after the block's `maester CMD` commands only
                                              (`tiny generate: --max-new-tokens 16`)
    <!-- docs-test: files PATH ... -->        example inputs the block assumes, written first by `write_input`
                                              below, or copied from the block that `makes` them
    <!-- docs-test: makes PATH ... -->        the block's commands make PATH (jobs/demo: the Quick start): it
                                              runs in a directory shared by the session, once, and blocks that
                                              need PATH get a copy
    <!-- docs-test: skip slurm: REASON -->    needs sbatch and a cluster: not run here (tests/slurm covers them)
    <!-- docs-test: skip gpu: REASON -->      needs GPUs: not run here (scripts/gpu-check.sh)
    <!-- docs-test: skip network: REASON -->  needs the Hugging Face Hub or the internet: not run here
    <!-- docs-test: skip slow: REASON -->     minutes of work even when tiny; REASON names the test that runs it

A block with a command that cannot run as written here fails until it is marked, so new docs stay runnable.

The tests at the end hold the pages together: every relative link of README.md and docs/*.md reaches a file and, into
a Markdown file, a heading (by GitHub's anchor rules), every docs/*.md page is reachable from README.md, and README.md
stays a landing page (at most 250 lines, a Quick start of exactly its two commands).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TRAINING = (("train",), ("seed-checkpoint",), ("submit",), ("sweep", "submit"))
# A training command in seconds: two steps of 16 x 64 tokens (micro-batches of 16 keep the evaluation of the
# held-out splits to few forwards), logged and saved at the end.
TINY_TRAIN = ["--training.steps=2", "--training.global_batch_size=16", "--training.micro_batch_size=16",
              "--data.seq_len=64", "--logging.interval=1"]
SKIP_KINDS = {"slurm": "needs SLURM", "gpu": "needs a GPU", "network": "needs the network", "slow": "slow"}
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^\s*```")
COMMAND = re.compile(r"^(?P<env>(?:[A-Z_][A-Z0-9_]*=\S*\s+)*)(?:uv run (?:--no-sync )?)?(?:python -m )?"
                     r"(?P<tool>maester|torchrun)\s(?P<rest>.*)$")
ERROR_LINE = re.compile(r"^maester [\w -]+: error: ")


@dataclass
class Command:
    line: int
    text: str
    expected_error: str | None = None
    stdin: list[str] = field(default_factory=list)


@dataclass
class Block:
    doc: str
    line: int
    commands: list[Command]
    tiny: list[tuple[tuple[str, ...], list[str]]] = field(default_factory=list)  # (command words or (), args)
    tiny_training: bool = False
    files: list[str] = field(default_factory=list)
    makes: list[str] = field(default_factory=list)
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file that hold maester commands, with their directives."""
    lines = path.read_text().splitlines()
    doc = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    blocks, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        commands = _commands(body)
        if commands:
            blocks.append(_with_directives(Block(doc, start + 1, commands), lines, start))
    return blocks


def _commands(body: list[tuple[int, str]]) -> list[Command]:
    """The block's commands (continuation lines joined), each with what the console block shows after it."""
    logical: list[tuple[int, str]] = []  # (first line, text with continuations joined)
    for number, raw in body:
        text = raw.strip()
        if logical and logical[-1][1].endswith("\\"):
            logical[-1] = (logical[-1][0], logical[-1][1][:-1].rstrip() + " " + text)
        else:
            logical.append((number, text))
    commands: list[Command] = []
    for number, text in logical:
        command = text.removeprefix("$ ")
        if ERROR_LINE.match(text):  # what the console shows after the command before it
            if commands and commands[-1].expected_error is None:
                commands[-1].expected_error = text
        elif COMMAND.match(command):
            commands.append(Command(number, command))
        elif commands and text.startswith("you> ") and " chat " in f" {commands[-1].text} ":
            commands[-1].stdin.append(text[len("you> "):])
    return commands


def _with_directives(block: Block, lines: list[str], fence: int) -> Block:
    """The `<!-- docs-test: ... -->` lines right above the fence, in document order, applied to the block."""
    first = fence
    while first > 0 and DIRECTIVE.match(lines[first - 1]):
        first -= 1
    for k in range(first, fence):
        word, _, rest = DIRECTIVE.match(lines[k])[1].partition(" ")
        if word == "tiny":
            scope, colon, args = rest.partition(":")
            if not colon or scope.startswith("-"):
                scope, args = "", rest
            if rest:
                block.tiny.append((tuple(scope.split()), shlex.split(args)))
            block.tiny_training = block.tiny_training or not rest
        elif word in ("files", "makes"):
            getattr(block, word).extend(rest.split())
        elif word == "skip":
            kind, _, reason = rest.partition(":")
            if kind.strip() not in SKIP_KINDS or not reason.strip():
                raise ValueError(f"{block.doc}:{k + 1}: `skip KIND: REASON` with KIND one of {', '.join(SKIP_KINDS)}")
            block.skip = f"{SKIP_KINDS[kind.strip()]}: {reason.strip()}"
        else:
            raise ValueError(f"{block.doc}:{k + 1}: unknown docs-test directive {word!r}")
    return block


BLOCKS = [b for doc in DOCS for b in read_blocks(doc)]
MAKERS = {path: b for b in BLOCKS for path in b.makes}


def test_the_docs_have_command_blocks_and_every_directive_is_known():
    """The collection itself: the README's Quick start is found, with its tiny mark; a torchrun block is marked."""
    assert BLOCKS[0].doc == "README.md" and BLOCKS[0].commands[0].text == "uv run maester train configs/demo.toml"
    assert BLOCKS[0].tiny_training
    assert all(b.skip for b in BLOCKS if any(COMMAND.match(c.text)["tool"] == "torchrun" for c in b.commands))
    assert MAKERS["jobs/demo"] is BLOCKS[0]
    needed = {name for b in BLOCKS for name in b.files}
    assert all(not MAKERS[name].skip for name in needed if name in MAKERS)


def test_blocks_commands_and_directives_are_read_as_documented(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("""text

<!-- docs-test: tiny -->
<!-- docs-test: tiny generate: --max-new-tokens 4 -->
<!-- docs-test: files jobs/demo data/a.jsonl -->
```bash
MAESTER_TRAINING__STEPS=10 uv run maester train configs/demo.toml \\
    --logging.interval=1   # a comment
uv run pytest
```

```
$ maester data tokenize data/b.jsonl.gz --output-prefix x --tokenizer byte
maester data: error: data/b.jsonl.gz:2: blank line
$ maester chat jobs/demo
you> hello
assistant> hi
you> /quit
```

<!-- docs-test: skip gpu: eight of them -->
```bash
torchrun --nproc_per_node=8 -m maester train jobs/x
```
""")
    first, second, third = read_blocks(doc)
    assert first.tiny_training and first.tiny == [(("generate",), ["--max-new-tokens", "4"])]
    assert first.files == ["jobs/demo", "data/a.jsonl"] and first.skip is None
    assert [c.text for c in first.commands] == ["MAESTER_TRAINING__STEPS=10 uv run maester train configs/demo.toml "
                                                "--logging.interval=1   # a comment"]
    env, argv = argv_of(first.commands[0].text, tmp_path)
    assert env == {"MAESTER_TRAINING__STEPS": "10"} and argv == ["train", "configs/demo.toml", "--logging.interval=1"]
    tokenize, chat = second.commands
    assert tokenize.expected_error == "maester data: error: data/b.jsonl.gz:2: blank line"
    assert chat.expected_error is None and chat.stdin == ["hello", "/quit"]
    assert third.skip == "needs a GPU: eight of them"


# ---------------------------------------------------------------- fixtures: the inputs the examples assume


def _write_docs(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


TEXTS = ["The cat sat on the mat.", "Hello, world!", "The quick brown fox jumps over the lazy dog."]
CHATS = [{"messages": [{"role": "user", "content": "What does len do?"},
                       {"role": "assistant", "content": "It returns the number of items."}]}] * 3


def write_input(name: str, root: Path) -> None:
    """Writes the example input `name` (a path as a block's commands name it) under `root`."""
    from tests.data.test_chat import write_hf
    from tests.data.test_sft_indexed import MARKED_TOKENIZER, write_marker_jsonl
    from tests.data.test_tokenizers_more import write_sentencepiece

    from maester.config import TokenizerConfig
    from maester.tools.data_tokenize import tokenize

    target = root / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if name == "data/seed.jsonl":
        write_marker_jsonl(target, 4)
    elif name == "path/to/tokenizer.model":  # SentencePiece with <|user|> and <|assistant|> as symbols
        write_sentencepiece(target)
    elif name == "path/to/tokenizer.json":  # a byte-level BPE with the chat templates' special tokens
        write_hf(target.parent)
    elif name == "llama3/tokenizer.model":  # a tiktoken rank file, as Llama 3's tokenizer.model is one
        import base64

        target.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    elif name == "data/b.jsonl.gz":  # the docs' example of a bad record: a blank line 2
        target.write_bytes(gzip.compress(b'{"text": "one"}\n\n{"text": "three"}\n'))
    elif name in ("data/web.jsonl", "data/raw/web.jsonl"):
        _write_docs(target, TEXTS)
    elif name == "data/web.jsonl.zst":
        import zstandard

        target.write_bytes(zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()))
    elif name == "data/chat/a.jsonl.zst":
        import zstandard

        target.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(c) + "\n" for c in CHATS).encode()))
    elif name in ("data/part1", "data/part2_text_document", "data/part3", "data/corpus_text_document"):
        prefix = name.removesuffix("_text_document")  # tokenize appends _text_document to its prefix
        _write_docs(root / "docs.jsonl", TEXTS)
        tokenize([str(root / "docs.jsonl")], str(root / prefix), TokenizerConfig(kind="byte"), append_eod=True)
        (root / "docs.jsonl").unlink()
        if prefix == name:  # a merged dataset's naming: the prefix as given
            for suffix in (".bin", ".idx"):
                (root / f"{prefix}_text_document{suffix}").rename(root / f"{name}{suffix}")
    elif name == "data/seed_text_document":  # the markers example tokenized with the byte tokenizer
        write_marker_jsonl(root / "seed.jsonl", 2)
        tokenize([str(root / "seed.jsonl")], str(root / "data" / "seed"), MARKED_TOKENIZER,
                 chat={"template": "markers"})
        (root / "seed.jsonl").unlink()
    else:
        raise KeyError(f"no example input named {name!r}: add it to write_input in {Path(__file__).name}, or mark "
                       f"the block that makes it with `makes {name}`")


# ---------------------------------------------------------------- running a block


def argv_of(text: str, root: Path) -> tuple[dict[str, str], list[str]]:
    """The environment assignments and the arguments after `maester`, as bash splits and expands them in `root`."""
    match = COMMAND.match(text)
    env = dict(a.split("=", 1) for a in match["env"].split())
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {match['rest']}"], cwd=root, capture_output=True,
                         text=True, check=True)
    return env, out.stdout.split("\0")[:-1]


def run_command(argv: list[str], stdin: list[str], monkeypatch) -> tuple[int, str, str]:
    from maester.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in stdin)))
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True) for _ in range(2))
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, *(stream.buffer.getvalue().decode(errors="replace") for stream in (out, err))


@pytest.fixture(scope="session")
def docs_session(tmp_path_factory):
    """The directory the `makes` blocks run in, and the cache of the built-in corpora, for the whole session."""
    root = tmp_path_factory.getbasetemp() / "docs-session"
    root.mkdir()
    (root / "configs").symlink_to(REPO / "configs")
    return root


class BlockRunner:
    """Runs blocks in a directory laid out like the repository root, with this process's working directory and
    environment set for each command (restored by `monkeypatch`)."""

    def __init__(self, session: Path, monkeypatch):
        self.session, self.monkeypatch = session, monkeypatch
        monkeypatch.setenv("XDG_CACHE_HOME", str(session / "cache"))
        for name in [k for k in os.environ if k.startswith("MAESTER_")]:
            monkeypatch.delenv(name)

    def run(self, block: Block, root: Path) -> None:
        for name in block.files:
            self.provide(name, root)
        for command in block.commands:
            self.monkeypatch.chdir(root)
            self.run_command(block, command, root)
        if root == self.session:
            _MADE.add(block.id)

    def provide(self, name: str, root: Path) -> None:
        maker = MAKERS.get(name)
        if maker is None:
            write_input(name, root)
            return
        if maker.id not in _MADE:
            self.run(maker, self.session)
        if root != self.session:
            shutil.copytree(self.session / name, root / name, symlinks=True)

    def run_command(self, block: Block, command: Command, root: Path) -> None:
        where = f"{block.doc}:{command.line}: {command.text}"
        assert COMMAND.match(command.text)["tool"] == "maester", f"{where}: torchrun is not run here: mark the block"
        env, argv = argv_of(command.text, root)
        for key, value in env.items():
            self.monkeypatch.setenv(key, value)
        training = any(tuple(argv[:len(t)]) == t for t in TRAINING)
        argv += TINY_TRAIN if block.tiny_training and training else []
        for scope, args in block.tiny:
            argv += args if tuple(argv[:len(scope)]) == scope else []
        code, out, err = run_command(argv, command.stdin, self.monkeypatch)
        for key in env:
            self.monkeypatch.delenv(key)
        if command.expected_error:
            assert code == 2 and command.expected_error in err, \
                f"{where}: expected exit 2 and {command.expected_error!r}, got exit {code}: {err[-2000:]}"
        else:
            assert code == 0, f"{where}: exit {code}\n{err[-3000:]}"


_MADE: set[str] = set()  # the `makes` blocks run in this session's shared directory


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_runs_as_written(block: Block, docs_session, tmp_path, monkeypatch):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    root = docs_session
    if not block.makes:  # a fresh directory like the repository root
        root = tmp_path / "repo"
        root.mkdir()
        (root / "configs").symlink_to(REPO / "configs")
    BlockRunner(docs_session, monkeypatch).run(block, root)


# ---------------------------------------------------------------- links between the pages; the README's shape

MAX_README_LINES = 250
QUICK_START = ["uv run maester train configs/demo.toml", "uv run pytest"]
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)+?\1", re.DOTALL)  # within a paragraph, across its lines
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(path: Path) -> str:
    """A Markdown file's text with the lines of its fenced blocks emptied (so line numbers stay)."""
    lines, fence = [], False
    for line in path.read_text().splitlines():
        inside = fence or bool(FENCE.match(line))
        fence = fence != bool(FENCE.match(line))
        lines.append("" if inside else line)
    return "\n".join(lines)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lower-cased, punctuation dropped, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path).splitlines():
        if match := HEADING.match(line):
            anchor = github_anchor(match[2])
            out.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """The relative link targets of a Markdown file's prose (images included), with their lines."""
    text = CODE_SPAN.sub(lambda m: "code" + "\n" * m[0].count("\n"), prose(path))
    return [(text.count("\n", 0, m.start()) + 1, m[1]) for m in LINK.finditer(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m[1])]  # https:, mailto:, ...


def link_problems(pages: list[Path], root: Path) -> list[str]:
    """Each relative link of `pages` to a file that is missing, or to a heading its Markdown file does not have."""
    problems = []
    for page in pages:
        for number, target in links(page):
            name, _, anchor = target.partition("#")
            path = (page.parent / name).resolve() if name else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not path.is_relative_to(root.resolve()) or not path.exists():
                problems.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{where}: no heading with that anchor in {path.relative_to(root.resolve())}")
    return problems


def unreachable_pages(root: Path) -> list[str]:
    """The docs/*.md pages that no chain of links from README.md reaches."""
    seen, todo = {(root / "README.md").resolve()}, [(root / "README.md").resolve()]
    while todo:
        page = todo.pop()
        for _, target in links(page):
            path = (page.parent / target.partition("#")[0]).resolve()
            if path.suffix == ".md" and path.is_file() and path not in seen:
                seen.add(path)
                todo.append(path)
    return [str(p.relative_to(root)) for p in sorted((root / "docs").glob("*.md")) if p.resolve() not in seen]


def landing_page_problems(readme: Path) -> list[str]:
    """What keeps README.md from being a landing page: its length, and a Quick start of other than the two commands."""
    lines = readme.read_text().splitlines()
    problems = [f"{readme.name}: {len(lines)} lines, more than {MAX_README_LINES}"] * (len(lines) > MAX_README_LINES)
    start = next((i for i, line in enumerate(lines) if line.strip() == "## Quick start"), None)
    if start is None:
        return [*problems, f"{readme.name}: no '## Quick start' section"]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    outside = prose(readme).splitlines()
    commands = [line.strip() for line, text in zip(lines[start:end], outside[start:end])
                if not text and not FENCE.match(line) and line.strip() and not line.strip().startswith("#")]
    if commands != QUICK_START:
        problems.append(f"{readme.name}: the Quick start's commands are {commands}, not {QUICK_START}")
    return problems


def test_every_link_between_the_pages_resolves():
    assert link_problems(DOCS, REPO) == []


def test_every_docs_page_is_reachable_from_the_readme():
    assert unreachable_pages(REPO) == []


def test_the_readme_is_a_landing_page_with_a_two_command_quick_start():
    assert landing_page_problems(REPO / "README.md") == []


def test_broken_links_unreachable_pages_and_a_long_readme_are_found(tmp_path):
    """The checks above on pages made to fail them, and GitHub's anchor rules on headings like ours."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n\n## Quick start\n\n```bash\nuv run maester train configs/demo.toml\n"
                                        "uv run pytest\nuv run maester report jobs/demo\n```\n\n"
                                        "[a](docs/a.md#the-tokenizer---tokenizer-spec) [b](docs/a.md#μp-1) "
                                        "[c](docs/a.md#nope) [d](docs/gone.md) [e](#quick-start) [f](#x-1)\n"
                                        "`[not a link](docs/gone.md)` [web](https://example.com/#nope)\n"
                                        "`a span\nover lines` [g](#nope-2) `[hidden](docs/gone.md)\nacross lines`\n"
                                        + "\n" * MAX_README_LINES)
    (tmp_path / "docs" / "a.md").write_text("# A\n## The tokenizer: `--tokenizer SPEC`\n## μP\n### μP\n"
                                            "```\n# not a heading\n```\n[back](../README.md#quick-start)\n")
    (tmp_path / "docs" / "b.md").write_text("# B, linked from nowhere\n[bad](a.md#not-a-heading)\n")
    assert link_problems([tmp_path / "README.md", *sorted((tmp_path / "docs").glob("*.md"))], tmp_path) == [
        "README.md:11: docs/a.md#nope: no heading with that anchor in docs/a.md",
        "README.md:11: docs/gone.md: no such file",
        "README.md:11: #x-1: no heading with that anchor in README.md",
        "README.md:14: #nope-2: no heading with that anchor in README.md",
        "docs/b.md:2: a.md#not-a-heading: no heading with that anchor in docs/a.md"]
    assert unreachable_pages(tmp_path) == ["docs/b.md"]
    assert landing_page_problems(tmp_path / "README.md") == [
        f"README.md: {15 + MAX_README_LINES} lines, more than {MAX_README_LINES}",
        f"README.md: the Quick start's commands are {QUICK_START + ['uv run maester report jobs/demo']}, "
        f"not {QUICK_START}"]
