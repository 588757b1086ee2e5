"""`maester chat` on a real pseudo-terminal: the model stays loaded over several turns, the conversation is kept
(each answer is the one `generate` gives the whole conversation), /system and /reset change what is sent."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import torch

from maester.tools.generate import Completer, Prompt, load_for_inference
from tests.helpers import clean_env, seed_job


class Terminal:
    """`maester ARGS` with stdin, stdout and stderr on one pseudo-terminal."""

    def __init__(self, args: list[str], cwd):
        self.leader, follower = os.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "maester", *args], cwd=cwd, env=clean_env(),
                                     stdin=follower, stdout=follower, stderr=follower)
        os.close(follower)
        self.raw, self.read = b"", 0  # everything the terminal showed; how many characters of it were consumed

    def until(self, text: str, timeout: float = 120) -> str:
        """Read until `text` has been shown after what was read before; returns what came before it."""
        deadline = time.monotonic() + timeout
        while text not in self.shown():
            ready, _, _ = select.select([self.leader], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {text!r} on the terminal within {timeout}s; it shows:\n{self.shown()}")
            try:
                self.raw += os.read(self.leader, 65536)
            except OSError:  # the child closed the terminal
                raise AssertionError(f"the command ended; the terminal shows:\n{self.shown()}") from None
        before, _, _ = self.shown().partition(text)
        self.read += len(before) + len(text)
        return before

    def shown(self) -> str:
        """What the terminal showed since the last `until` (decoded whole: a character may span two reads)."""
        return self.raw.decode(errors="replace").replace("\r\n", "\n")[self.read:]

    def send(self, line: str) -> None:
        os.write(self.leader, (line + "\n").encode())
        self.until(line + "\n")  # the terminal's echo

    def answer(self, line: str) -> str:
        self.send(line)
        self.until("assistant> ")
        return self.until("\nyou> ")


def test_a_conversation_on_a_terminal(corpus, tmp_path):
    # Random weights drawn wide enough that every context below leads to a different answer; the byte tokenizer's
    # own vocabulary (a random model picks padding ids too, which it refuses to decode).
    job = seed_job(corpus, tmp_path / "jobs", "chat",
                   model__overrides='{"dim": 128, "n_layers": 4, "init_std": 0.2, "vocab_size": 269}')
    options = ["--max-new-tokens", "8"]

    model, tokenizer, cfg = load_for_inference(job, torch.device("cpu"))
    completer = Completer(model, tokenizer, cfg, max_new_tokens=8)

    def generated(messages: list[dict]) -> str:
        """What `generate` answers to the conversation `messages`."""
        return completer.complete(Prompt("test", messages=messages))

    term = Terminal(["chat", str(job), *options], tmp_path)
    term.until("you> ")
    first = term.answer("what is a token?")
    second = term.answer("and a step?")
    term.send("/system Be brief.")
    term.until("you> ")
    third = term.answer("and a step?")
    term.send("/reset")
    term.until("(conversation cleared)\nyou> ")
    again = term.answer("what is a token?")
    os.write(term.leader, b"\x04")  # Ctrl-D ends the session
    assert term.proc.wait(timeout=60) == 0
    os.close(term.leader)

    user1, user2 = {"role": "user", "content": "what is a token?"}, {"role": "user", "content": "and a step?"}
    system = {"role": "system", "content": "Be brief."}
    assert first == generated([user1])
    history = [user1, {"role": "assistant", "content": first}, user2]
    assert second == generated(history)
    assert third == generated([system, *history, {"role": "assistant", "content": second}, user2])
    assert again == generated([system, user1])  # /reset keeps the system prompt
    assert len({first, second, third, again}) == 4  # each context leads elsewhere, so the comparisons can fail
