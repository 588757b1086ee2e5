"""Writes the two tiny offline tasks beside this file from the built-in `pydoc` corpus (the demo's training
text): `python -m maester.evaluation.pydoc_tasks.build`. The shipped JSONL files were written by it on Python 3.11;
another Python's documentation gives other sentences.

- `pydoc_choice` (multiple choice, `acc` and `acc_norm`): a sentence's first words, and four endings to choose
  from: its own, and three orders of the same words (a grammaticality test, as BLiMP's minimal pairs are; the
  choices have the same length, so `acc_norm` is `acc`).
- `pydoc_complete` (generation, `exact_match`): the words before a long word and its first three letters; the
  answer is the rest of that word, up to the space after it.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
QUESTIONS = 100
_SENTENCE_END = re.compile(r"(?<=[a-z)]\.)\s+(?=[A-Z])")
_PLAIN = re.compile(r"[A-Za-z0-9 ,;:'()-]+\.")
_LONG_WORD = re.compile(r"(?<= )[a-z]{8,}(?=[ ,;:.])")


def sentences() -> list[str]:
    """Plain-prose sentences of 8 to 24 words from the corpus's unindented paragraphs, each once, in corpus
    order."""
    from maester.data.builtin_corpora import pydoc_documents

    seen: dict[str, None] = {}
    for doc in pydoc_documents():
        for paragraph in doc.split("\n\n"):
            if not paragraph.strip() or paragraph.startswith((" ", "\t")) or "\n*" in paragraph:
                continue
            for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
                if _PLAIN.fullmatch(sentence) and 8 <= len(sentence.split()) <= 24 and sentence[0].isupper():
                    seen[sentence] = None
    return list(seen)


def choice_questions(pool: list[str], rng: random.Random) -> list[dict]:
    rows = []
    for sentence in rng.sample(pool, len(pool)):
        words = sentence.split()
        cut = round(len(words) * 0.6)
        ending = words[cut:]
        if len(ending) < 4:
            continue
        endings = {" ".join(ending)}
        while len(endings) < 4:
            endings.add(" ".join(rng.sample(ending, len(ending))))
        choices = sorted(endings)
        rng.shuffle(choices)
        rows.append({"context": " ".join(words[:cut]), "choices": choices, "label": choices.index(" ".join(ending))})
        if len(rows) == QUESTIONS:
            break
    return rows


def completion_questions(pool: list[str], rng: random.Random) -> list[dict]:
    rows = []
    for sentence in rng.sample(pool, len(pool)):
        words = list(_LONG_WORD.finditer(sentence))
        if not words:
            continue
        word = rng.choice(words)
        before = sentence[:word.start()].split()[-12:]
        rows.append({"context": " ".join(before) + " " + word.group()[:3], "completion": word.group()[3:]})
        if len(rows) == QUESTIONS:
            break
    return rows


def main() -> None:
    rng = random.Random(0)
    pool = sentences()
    for name, rows in (("pydoc_choice", choice_questions(pool, rng)),
                       ("pydoc_complete", completion_questions(pool, rng))):
        path = HERE / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {path}: {len(rows)} questions")


if __name__ == "__main__":
    main()
