"""`maester chat`: a conversation with a model that stays loaded; each answer streams as it is generated."""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from maester.tools.generate import Completer, Prompt

HELP = "/reset forgets the conversation, /system TEXT sets the system prompt (/system alone: the default), /quit"


class ChatSession:
    """The conversation so far and the system prompt that opens it (None: the config's `data.sft.system_prompt`).
    Every turn sends the whole conversation in the chat template."""

    def __init__(self, completer: Completer, system: str | None = None):
        self.completer, self.system = completer, system
        self.history: list[dict] = []

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def reset(self) -> None:
        self.history = []

    def answer(self, text: str, write: Callable[[str], None]) -> str:
        """The assistant's answer to the user's `text`, streamed to `write`; both join the conversation. A turn
        that fails (the conversation outgrew the context) leaves the conversation as it was."""
        self.history.append({"role": "user", "content": text})
        try:
            reply = self.completer.stream(Prompt("chat", messages=self.messages()), write)
        except BaseException:
            self.history.pop()
            raise
        self.history.append({"role": "assistant", "content": reply})
        return reply


def run_session(session: ChatSession, read_line: Callable[[str], str], out: TextIO) -> None:
    """Read the user's lines until /quit or end of input (Ctrl-D), answering each; slash commands change the
    session."""
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    write(f"{HELP}\n")
    while True:
        try:
            line = read_line("you> ").strip()
        except EOFError:
            write("\n")
            return
        if not line:
            continue
        command, _, rest = line.partition(" ")
        if command in ("/quit", "/exit"):
            return
        if command == "/reset":
            session.reset()
            write("(conversation cleared)\n")
        elif command == "/system":
            session.system = rest.strip() or None
            write(f"(system prompt: {session.system!r}; the conversation is kept, /reset clears it)\n"
                  if session.system else "(system prompt: the default)\n")
        elif command.startswith("/"):
            write(f"unknown command {command}: {HELP}\n")
        else:
            write("assistant> ")
            try:
                session.answer(line, write)
            except ValueError as e:  # the conversation no longer fits the context
                write(f"\nerror: {e}; /reset clears the conversation")
            write("\n")
