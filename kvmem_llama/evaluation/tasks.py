"""RULER-style synthetic tasks: seeded generators whose prompts fill a target token length.

Every task builds its prompt from a haystack of `n` units (words, or list entries for the
common-words task); `fit_sample` searches `n` with the server's tokenizer so the prompt is
as long as requested (never longer; short by less than one unit, i.e. a few tokens).
A sample depends only on (seed, task, length, depth, index): every configuration of a
comparison sees exactly the same prompts, and the depths of one sample share their haystack.
`niah_followup` is a two-request chat: its first user turn (a document, answered but not
scored) is `Sample.history`, the scored second turn is `Sample.prompt`.

One module on purpose (~520 lines): the twelve generators share the haystack, the needle placement,
the seeding rule and the length fitting; split per task, each file would carry those rules again.
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation import corpus

NIAH_TEMPLATE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the numbers afterwards.\n{context}\n{question}")
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\n{question}")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n{question}")
CWE_QUESTION = ("Question: What are the {n} most common words in the above list? "
                "Answer: The top {n} words that appear most often in the list are:")
FOLLOWUP_FIRST = ("Some special magic numbers are hidden within the following documents. Make sure to memorize "
                  "them. I will quiz you about the numbers afterwards. Here is the first document:\n{context}\n"
                  "Reply with OK once you have read it; the second document follows.")
FOLLOWUP_SECOND = "Here is the second document:\n{context}\n{question}"
FOLLOWUP_SHARE_A = 0.45  # of the haystack words: document A; the rest (and the needle) is document B
SPREAD = re.compile(r"^spread(\d+)$")


@dataclass
class Built:
    """One prompt for a given haystack size, with where its parts sit (character offsets)."""

    prompt: str
    expected: list[str]
    context_span: tuple[int, int]
    needle_offsets: list[int] = field(default_factory=list)  # targets only, in prompt order
    answer_pool: frozenset[str] | None = None  # cwe: the words of the list (see scoring.score)
    # where each target's answer begins (a needle's value; a vt statement's variable), for the hit rate
    answer_offsets: list[int] = field(default_factory=list)
    history: list[str] = field(default_factory=list)  # earlier user turns (niah_followup's document A)


@dataclass
class Sample:
    task: str
    length: int  # requested tokens
    depth: int | None  # percent of the context where the answer sits; None for tasks without one
    index: int
    seed: int
    prompt: str
    expected: list[str]
    max_tokens: int
    tokens: int  # measured prompt tokens (server tokenizer, no special tokens)
    units: int  # haystack size that produced `tokens`
    context_span: tuple[int, int]
    needle_offsets: list[int]
    answer_pool: frozenset[str] | None = None
    answer_offsets: list[int] = field(default_factory=list)  # character offsets in `prompt`
    history: list[str] = field(default_factory=list)  # earlier user turns, each answered first
    history_max_tokens: int = 0  # answer limit of each earlier turn (reserved in `tokens`)


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    build: Callable[[random.Random, int, int | None, int], Built]  # (rng, n units, depth, length)
    max_tokens: int
    uses_depth: bool = True
    history_max_tokens: int = 0  # > 0: a multi-turn task; each earlier turn's answer is capped at this


def measure_text(built: Built) -> str:
    """The text whose tokens a sample's length counts: every user turn, joined by newlines."""
    return "\n".join([*built.history, built.prompt])


# ---------------------------------------------------------------- helpers

def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _keys(rng: random.Random, count: int) -> list[str]:
    words = corpus.vocabulary()
    keys: list[str] = []
    while len(keys) < count:
        a, b = rng.sample(words, 2)
        key = f"{a}-{b}"
        if key not in keys:
            keys.append(key)
    return keys


def _snap(words: list[str], idx: int) -> int:
    """The sentence boundary (count of words before it) nearest to `idx`, within 1% of the haystack (>= 12 words)."""
    n = len(words)
    window = max(12, n // 100)
    idx = max(0, min(n, idx))
    for delta in range(window + 1):
        for k in (idx - delta, idx + delta):
            if 0 <= k <= n and (k in (0, n) or corpus.is_sentence_end(words[k - 1])):
                return k
    return idx  # no boundary near: insert between words


def _fill(words: list[str], needles: list[tuple[float, str, int | None]]) -> tuple[str, list[int], list[int]]:
    """Insert needle sentences at fractional positions of `words`.

    A needle is (fraction, text, answer): `answer` is where the answer begins inside a target's
    text, None for a distractor. Returns the text, the targets' offsets and their answers' offsets.
    """
    # depth is a fraction of the whole context, needles included: count needle words as context
    total = len(words) + sum(len(text.split()) for _, text, _ in needles)
    placed = []
    before = 0  # needle words ahead of the current needle
    at = 0
    ranked = sorted(enumerate(needles), key=lambda e: (e[1][0], e[0]))
    for rank, (_, (frac, text, target)) in enumerate(ranked):
        # snapping may move a needle across its neighbour: keep them in the order of their depths
        at = max(at, _snap(words, round(frac * total) - before))
        placed.append((at, rank, text, target))
        before += len(text.split())
    parts: list[str] = []
    offsets: list[int] = []
    answers: list[int] = []
    pos = 0
    cursor = 0

    def add(piece: str) -> int:
        nonlocal pos
        if parts:
            parts.append(" ")
            pos += 1
        start = pos
        parts.append(piece)
        pos += len(piece)
        return start

    for at, _, text, target in placed:
        if at > cursor:
            add(" ".join(words[cursor:at]))
            cursor = at
        start = add(text)
        if target is not None:
            offsets.append(start)
            answers.append(start + target)
    if cursor < len(words):
        add(" ".join(words[cursor:]))
    return "".join(parts), offsets, answers


def _render(template: str, context: str, question: str, offsets: list[int], expected: list[str],
            answers: list[int] | None = None) -> Built:
    head = template.split("{context}")[0]
    prompt = template.format(context=context, question=question)
    start = len(head)
    return Built(prompt, expected, (start, start + len(context)), [start + o for o in offsets],
                 answer_offsets=[start + o for o in answers or []])


def _cluster(depth: int | None, count: int, spread: float) -> list[float]:
    """`count` positions around `depth` percent, `spread` wide, kept inside the context."""
    center = (depth if depth is not None else 50) / 100
    if count == 1:
        return [center]
    lo = min(max(center - spread / 2, 0.0), 1.0 - spread)
    return [lo + spread * i / (count - 1) for i in range(count)]


def _essay_start(rng: random.Random) -> int:
    words = corpus.essay_words()
    k = rng.randrange(len(words))
    while k < len(words) and not corpus.is_sentence_end(words[k - 1] if k else "."):
        k += 1
    return k % len(words)


def _haystack(rng: random.Random, kind: str, n: int) -> list[str]:
    if kind == "noise":
        return corpus.take_words(corpus.noise_words(), 0, n)
    return corpus.take_words(corpus.essay_words(), _essay_start(rng), n)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _target(key: str, value: str) -> tuple[str, int]:
    """A target needle and where its value (the answer) starts in it."""
    text = _needle(key, value)
    return text, text.rindex(value)


def _ask(keys: list[str]) -> str:
    if len(keys) == 1:
        k = keys[0]
        return (f"What is the special magic number for {k} mentioned in the provided text? "
                f"The special magic number for {k} mentioned in the provided text is")
    joined = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return (f"What are all the special magic numbers for {joined} mentioned in the provided text? "
            f"The special magic numbers for {joined} mentioned in the provided text are")


# ---------------------------------------------------------------- tasks

def _niah(kind: str, n_keys: int = 1, n_values: int = 1, n_queries: int = 1) -> Callable:
    """One builder for the whole NIAH family; all draws happen before the haystack is sized."""

    def build(rng: random.Random, n: int, depth: int | None, length: int) -> Built:
        keys = _keys(rng, n_keys)
        values = {k: [_number(rng) for _ in range(n_values)] for k in keys}
        queried = keys[:n_queries]
        distractor_fracs = [rng.random() for _ in keys[n_queries:]]
        words = _haystack(rng, kind, n)
        targets = [_target(k, v) for k in queried for v in values[k]]
        needles: list[tuple[float, str, int | None]] = [
            (f, text, at) for f, (text, at) in zip(_cluster(depth, len(targets), 0.1), targets, strict=True)]
        needles += [(f, _needle(k, values[k][0]), None)
                    for f, k in zip(distractor_fracs, keys[n_queries:], strict=True)]
        context, offsets, answers = _fill(words, needles)
        expected = [v for k in queried for v in values[k]]
        return _render(NIAH_TEMPLATE, context, _ask(queried), offsets, expected, answers)

    return build


# sentences that name a needle's key and its "special magic number" without a value, worded unlike the needle:
# what real text does when the question's words recur where the answer is not
DECOYS = (
    "Nobody in this chapter wrote down the special magic number for {key}.",
    "People often ask about {key} and its special magic number, but the answer is not given here.",
    "The special magic number for {key} was mentioned in a meeting, and everyone forgot it at once.",
    "Remember that {key} has a special magic number; this paragraph does not reveal it.",
    "Some say the special magic number for {key} changes every year.",
    "A note about {key}: its special magic number is kept somewhere else in the text.",
)
TWO_HOP_FIRST = "The special magic number for {key} is written on the card labelled {label}."
TWO_HOP_SECOND = "The card labelled {label} reads: {value}."


def _decoy_fracs(rng: random.Random, count: int, depth: int | None) -> list[float]:
    """`count` positions spread over the context (one per equal slice, jittered), clear of the needle's depth."""
    center = (depth if depth is not None else 50) / 100
    fracs = []
    for i in range(count):
        f = (i + rng.uniform(0.1, 0.9)) / count
        if abs(f - center) < 0.03:
            f = center + (0.03 if f >= center else -0.03)
        fracs.append(min(max(f, 0.0), 1.0))
    return fracs


def _niah_decoys(n_decoys: int) -> Callable:
    """One needle in essay text plus `n_decoys` sentences that repeat its key and phrase without the value."""

    def build(rng: random.Random, n: int, depth: int | None, length: int) -> Built:
        (key,) = _keys(rng, 1)
        value = _number(rng)
        decoys = [rng.choice(DECOYS).format(key=key) for _ in range(n_decoys)]
        fracs = _decoy_fracs(rng, n_decoys, depth)
        words = _haystack(rng, "essay", n)
        text, at = _target(key, value)
        needles: list[tuple[float, str, int | None]] = [((depth if depth is not None else 50) / 100, text, at)]
        needles += [(f, d, None) for f, d in zip(fracs, decoys, strict=True)]
        context, offsets, answers = _fill(words, needles)
        return _render(NIAH_TEMPLATE, context, _ask([key]), offsets, [value], answers)

    return build


def _two_hop(rng: random.Random, n: int, depth: int | None, length: int) -> Built:
    """The answer needs two blocks: the key's card label at `depth`, and far from it what that card reads."""
    (key,) = _keys(rng, 1)
    label = "".join(rng.choice(string.ascii_uppercase) for _ in range(3)) + _number(rng, 3)
    value = _number(rng)
    center = (depth if depth is not None else 50) / 100
    other = (center + 0.5) % 1.0  # half the context away
    words = _haystack(rng, "essay", n)
    first = TWO_HOP_FIRST.format(key=key, label=label)
    second = TWO_HOP_SECOND.format(label=label, value=value)
    # both statements are targets (the hit rate wants both blocks); the label answers the first hop
    needles = [(center, first, first.rindex(label)), (other, second, second.rindex(value))]
    context, offsets, answers = _fill(words, needles)
    question = (f"What is the special magic number for {key} mentioned in the provided text? (It is written on a "
                f"card; give what the card reads.) The special magic number for {key} mentioned in the provided "
                "text is")
    return _render(NIAH_TEMPLATE, context, question, offsets, [value], answers)


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _vt(rng: random.Random, n: int, depth: int | None, length: int, hops: int = 4) -> Built:
    value = _number(rng, 5)
    names: list[str] = []
    while len(names) < hops + 1:
        name = _var_name(rng)
        if name not in names:
            names.append(name)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    words = _haystack(rng, "noise", n)
    # a statement's answer is the variable it defines: "VAR <name> = ..."
    needles = [(f, s, len("VAR ")) for f, s in zip(_cluster(depth, len(statements), 0.2), statements, strict=True)]
    context, offsets, answers = _fill(words, needles)
    question = (f"Question: Find all variables that are assigned the value {value} in the text above. "
                f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
                f"are assigned the value {value}, they are:")
    return _render(VT_TEMPLATE, context, question, offsets, names, answers)


def _followup(rng: random.Random, n: int, depth: int | None, length: int) -> Built:
    """Two user turns: document A (answered, not scored), then document B with the needle + the question.

    The haystack is one run of essay words cut at a sentence end near FOLLOWUP_SHARE_A; the depth
    is the needle's place in document B, the part the follow-up prompt brings in.
    """
    (key,) = _keys(rng, 1)
    value = _number(rng)
    words = _haystack(rng, "essay", n)
    cut = _snap(words, round(FOLLOWUP_SHARE_A * n)) if n else 0
    first = FOLLOWUP_FIRST.format(context=" ".join(words[:cut]))
    text, at = _target(key, value)
    center = (depth if depth is not None else 50) / 100
    context, offsets, answers = _fill(words[cut:], [(center, text, at)])
    built = _render(FOLLOWUP_SECOND, context, _ask([key]), offsets, [value], answers)
    built.history = [first]
    return built


def _cwe_frequencies(length: int) -> tuple[int, int]:
    """(times each common word appears, times each other word appears), scaled to fit short contexts."""
    common = min(30, max(6, length // 256))
    return common, (2 if length < 4096 else 3)


@functools.lru_cache(maxsize=1)
def _cwe_pool() -> tuple[str, ...]:
    # no word of the instructions: an answer's preamble ("the most common words are") is never a list word
    taken = set(corpus.vocabulary()) | {w.lower() for w in re.findall(r"[A-Za-z]+", CWE_TEMPLATE + CWE_QUESTION)}
    seen = dict.fromkeys(w.strip(".,;:()\"'“”").lower() for w in corpus.essay_words())
    return tuple(w for w in seen if w.isalpha() and w.isascii() and len(w) >= 4 and w not in taken)


def _cwe(rng: random.Random, n: int, depth: int | None, length: int, n_common: int = 10) -> Built:
    f_common, f_other = _cwe_frequencies(length)
    common = rng.sample(corpus.vocabulary(), n_common)
    pool = list(_cwe_pool())
    rng.shuffle(pool)
    others: list[str] = []
    for i in range(n):  # n entries of rare words, each repeated f_other times
        others.append(pool[(i // f_other) % len(pool)])
    entries = [w for w in common for _ in range(f_common)] + others
    random.Random(rng.random()).shuffle(entries)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
    built = _render(CWE_TEMPLATE, context, CWE_QUESTION.format(n=n_common), [], common)
    built.answer_pool = frozenset(entries)
    return built


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("niah_single_noise", "one needle in repeated filler sentences", _niah("noise"), 32),
    Task("niah_single_essay", "one needle in prose (Python reference topics)", _niah("essay"), 32),
    Task("niah_multikey", "one needle among 3 distractor keys, essay haystack", _niah("essay", n_keys=4), 32),
    Task("niah_multivalue", "one key with 4 values, all must be returned", _niah("essay", n_values=4), 96),
    Task("niah_multiquery", "4 keys asked at once, all values must be returned",
         _niah("essay", n_keys=4, n_queries=4), 96),
    Task("niah_followup", "two requests: document A, then document B with the needle + the question "
         "(the follow-up prompt path, prompt cache reused)", _followup, 32, history_max_tokens=16),
    Task("niah_decoy4", "one needle + 4 sentences naming its key without the value, essay", _niah_decoys(4), 32),
    Task("niah_decoy8", "one needle + 8 sentences naming its key without the value, essay", _niah_decoys(8), 32),
    Task("niah_decoy16", "one needle + 16 sentences naming its key without the value, essay", _niah_decoys(16), 32),
    Task("niah_twohop", "two facts far apart: the key's card label, then what that card reads", _two_hop, 32),
    Task("vt", "variable tracking: a 4-hop chain of VAR X = VAR Y in filler", _vt, 96),
    Task("cwe", "common-words extraction: the 10 most frequent words of a numbered list", _cwe, 128,
         uses_depth=False),
)}

ALIASES = {
    "niah_single": ["niah_single_noise", "niah_single_essay"],
    "niah": ["niah_single_noise", "niah_single_essay", "niah_multikey", "niah_multivalue", "niah_multiquery",
             "niah_followup"],
    "followup": ["niah_followup"],
    "decoys": ["niah_decoy4", "niah_decoy8", "niah_decoy16"],
    "variable_tracking": ["vt"],
    "common_words": ["cwe"],
    "all": list(TASKS),
}


def _csv_items(text: str) -> list[str]:
    """The non-empty items of a comma list, stripped and lower-cased."""
    return [item for item in (raw.strip().lower() for raw in text.split(",")) if item]


def parse_tasks(spec: str) -> list[str]:
    out: list[str] = []
    for name in _csv_items(spec):
        for n in ALIASES.get(name, [name]):
            if n not in TASKS:
                raise KvmemError(f"unknown task {name!r}",
                                 hint=f"tasks: {', '.join(TASKS)}; groups: {', '.join(ALIASES)}")
            if n not in out:
                out.append(n)
    if not out:
        raise KvmemError("no tasks given", hint=f"e.g. --tasks niah_single,vt (all: {', '.join(TASKS)})")
    return out


def parse_depths(text: str) -> list[int]:
    """`10,50,90` or `spread10` (= 5,15,...,95: the middles of 10 equal slices); `spreadK` likewise."""
    out: list[int] = []
    for item in _csv_items(text):
        spread = SPREAD.match(item)
        if spread:
            k = int(spread[1])
            if not 1 <= k <= 100:
                raise KvmemError(f"bad depths {item!r}", hint="spreadK with K from 1 to 100, e.g. spread10")
            values = [round((i + 0.5) * 100 / k) for i in range(k)]
        else:
            try:
                values = [int(item)]
            except ValueError:
                raise KvmemError(f"bad depths {text!r}",
                                 hint="a comma list of percentages (10,50,90) or spread10 (= 5,15,...,95)") from None
        for v in values:
            if not 0 <= v <= 100:
                raise KvmemError("depths are percentages between 0 and 100")
            if v not in out:
                out.append(v)
    if not out:
        raise KvmemError("no depths given", hint="e.g. --depths 10,50,90 or --depths spread10")
    return out


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    """The draws of one sample. Depth is left out on purpose: across depths the haystack, keys and
    values stay the same and only the needle moves (and a server's prompt cache can reuse the prefix)."""
    # str seeds hash with sha512 in random's version 2: stable across runs and platforms
    return random.Random(f"kvmem-eval:{seed}:{task}:{length}:{index}")


def fit_sample(task_name: str, length: int, depth: int | None, index: int, seed: int,
               count_tokens: Callable[[str], int], max_probes: int = 40, hint: int | None = None) -> Sample:
    """Build the sample whose prompt is the longest not exceeding `length` tokens.

    A multi-turn task counts all its user turns plus the answer limit of the earlier ones, so
    the scored request's prompt stays within `length` whatever the model answered before.
    `hint` (the haystack size another depth of the same sample fitted to) saves most probes.
    """
    task = TASKS[task_name]
    if not task.uses_depth:
        depth = None
    cache: dict[int, tuple[Built, int]] = {}
    reserve = task.history_max_tokens

    def probe(n: int) -> int:
        if n not in cache:
            built = task.build(sample_rng(seed, task_name, length, index), n, depth, length)
            cache[n] = (built, count_tokens(measure_text(built)) + reserve * len(built.history))
        return cache[n][1]

    def done(n: int) -> Sample:
        built, tokens = cache[n]
        return Sample(task_name, length, depth, index, seed, built.prompt, built.expected, task.max_tokens,
                      tokens, n, built.context_span, built.needle_offsets, built.answer_pool,
                      built.answer_offsets, built.history, task.history_max_tokens)

    # the depths of one sample share the haystack: its size is within a unit or two of the hint
    if hint is not None and hint > 0 and probe(hint) <= length and probe(hint + 1) > length:
        return done(hint)

    base = probe(0)
    if base > length:
        raise KvmemError(f"{task_name}: the prompt without any haystack is already {base} tokens (> {length})",
                         hint="ask for a longer --lengths")
    step = 64
    ratio = max((probe(step) - base) / step, 0.05)  # tokens per unit
    lo, hi = 0, None  # invariant: probe(lo) <= length < probe(hi)
    guess = max(1, int((length - base) / ratio))
    last_side = ""
    for _ in range(max_probes):
        side = "lo" if probe(guess) <= length else "hi"
        if side == "lo":
            lo = max(lo, guess)
        else:
            hi = guess if hi is None else min(hi, guess)
        if hi is not None and hi - lo <= 1:
            break
        if hi is None:  # extrapolate past the target (+2 units) so that it gets bracketed
            slope = max((probe(lo) - base) / lo, 0.05) if lo else ratio
            guess = lo + max(2, int((length - probe(lo)) / slope) + 2)
        elif side == last_side:  # secant steps stall on one side: bisect instead
            guess = (lo + hi) // 2
        else:  # secant inside the bracket; nearly linear, so this lands within a unit or two
            f_lo, f_hi = probe(lo), probe(hi)
            guess = lo + int((length - f_lo) * (hi - lo) / max(f_hi - f_lo, 1))
            guess = min(max(guess, lo + 1), hi - 1)
        last_side = side
    return done(lo)
