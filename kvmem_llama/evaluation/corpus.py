"""Offline text sources for haystacks: RULER's noise filler, stdlib prose, a shipped word list.

Nothing here downloads. The essay haystack is the prose of the Python reference topics that
ship with every CPython (`pydoc_data.topics`), with code samples and headings removed, so it
is identical for one Python minor version; results record the Python version for that reason.
"""

from __future__ import annotations

import functools
import re
import sys
from importlib import resources

# RULER's noise haystack: short sentences repeated until the context is full.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_SENTENCE_END = re.compile(r"[.!?][\"”')\]]*$")


@functools.lru_cache(maxsize=1)
def essay_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs of the stdlib reference topics, in a fixed order."""
    import pydoc_data.topics as topics  # part of the stdlib; the text behind `help("topic")`

    out: list[str] = []
    for name in sorted(topics.topics):
        for block in re.split(r"\n\s*\n", topics.topics[name]):
            lines = block.split("\n")
            if not lines or lines[0].startswith((" ", "\t")):
                continue  # code samples, grammar, tables are indented
            if len(lines) > 1 and set(lines[1].strip()) <= set("*=-~^") and lines[1].strip():
                continue  # a heading with its underline
            text = " ".join(line.strip() for line in lines).strip()
            if text.startswith(("* ", "- ", "|", "+")):
                continue  # bullet lists and tables read badly as an essay
            if len(text) < 120 or not _SENTENCE_END.search(text) or text.endswith(":"):
                continue  # fragments and paragraphs that introduce a code block
            out.append(text)
    if not out:
        raise RuntimeError("pydoc_data.topics holds no prose; this Python build strips its docs")
    return tuple(out)


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay corpus as one long list of whitespace-separated words (paragraphs run on)."""
    return tuple(" ".join(essay_paragraphs()).split())


@functools.lru_cache(maxsize=1)
def noise_words() -> tuple[str, ...]:
    return tuple(NOISE.split())


def is_sentence_end(word: str) -> bool:
    return bool(_SENTENCE_END.search(word))


def take_words(source: tuple[str, ...], start: int, n: int) -> list[str]:
    """`n` words from `source` beginning at `start`, wrapping around when the corpus runs out."""
    if n <= 0:
        return []
    size = len(source)
    start %= size
    out: list[str] = []
    while len(out) < n:
        out.extend(source[start:start + (n - len(out))])
        start = 0
    return out


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """The shipped plain-word list (keys, common-words task)."""
    text = resources.files("kvmem_llama.evaluation").joinpath("data/words.txt").read_text("utf-8")
    words = [w.strip() for w in text.splitlines() if w.strip() and not w.startswith("#")]
    return tuple(dict.fromkeys(words))


def corpus_info() -> dict:
    """What the haystacks were made of, recorded next to results for reproducibility."""
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
            "essay_words": len(essay_words()), "vocabulary": len(vocabulary())}
