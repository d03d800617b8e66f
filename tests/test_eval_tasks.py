"""Task generators against the real llama-server tokenizer (SmolLM2): length, depth, content."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_llama_server

from kvmem_llama.engine import Engine
from kvmem_llama.evaluation.client import EvalClient
from kvmem_llama.evaluation.runner import Evaluation, Plan
from kvmem_llama.evaluation.tasks import FOLLOWUP_SHARE_A, TASKS, _cwe_frequencies, fit_sample

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def client(cpu_engine: Engine, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EvalClient]:
    # only /tokenize is used here: a tiny context, one thread
    log = tmp_path_factory.mktemp("eval-tasks") / "llama-server.log"
    with run_llama_server(cpu_engine, smollm2, ["-c", "512", "-t", "1", "-np", "1"], log) as srv:
        with EvalClient(srv.url) as c:
            yield c


def token_depth(client: EvalClient, prompt: str, span: tuple[int, int], offset: int) -> float:
    """Percent of the context's tokens that come before the character `offset`."""
    start, end = span
    before = client.count_tokens(prompt[start:offset].rstrip())
    return 100.0 * before / client.count_tokens(prompt[start:end])


@pytest.mark.parametrize("length", [700, 1500, 6000])
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_fills_requested_length(client: EvalClient, task: str, length: int) -> None:
    s = fit_sample(task, length, 50, 0, 7, client.count_tokens)
    # never over the target; short of it by less than one haystack unit (a word, or a list entry for cwe)
    # (niah_followup: moving the cut between its two documents to the next sentence end moves a few tokens)
    slack = {"cwe": 8, "niah_followup": 10}.get(task, 4)
    assert length - slack <= s.tokens <= length, (task, length, s.tokens)
    # what was measured is what is sent (+ the answer limit of an earlier turn, whose answer is not known yet)
    assert client.count_tokens("\n".join([*s.history, s.prompt])) + s.history_max_tokens * len(s.history) == s.tokens
    assert s.units > 0


@pytest.mark.parametrize("task", ["niah_single_noise", "niah_single_essay", "niah_multikey"])
@pytest.mark.parametrize("depth", [0, 10, 25, 50, 75, 90, 100])
def test_single_needle_sits_at_requested_depth(client: EvalClient, task: str, depth: int) -> None:
    s = fit_sample(task, 2000, depth, 1, 3, client.count_tokens)
    assert len(s.needle_offsets) == 1
    (offset,) = s.needle_offsets
    assert s.prompt[offset:].startswith("One of the special magic numbers for ")
    assert s.expected[0] in s.prompt[offset:offset + 120]  # the value asked for sits in that needle
    got = token_depth(client, s.prompt, s.context_span, offset)
    # placement is by words (needles' digits cost more tokens than words), so a few points of slack;
    # distractor needles of niah_multikey add a little more
    assert abs(got - depth) <= (4.0 if task == "niah_multikey" else 3.0), (task, depth, got)


@pytest.mark.parametrize("task", ["niah_multivalue", "niah_multiquery", "vt"])
@pytest.mark.parametrize("depth", [10, 50, 90])
def test_needle_clusters_centre_on_depth(client: EvalClient, task: str, depth: int) -> None:
    s = fit_sample(task, 2000, depth, 0, 3, client.count_tokens)
    depths = [token_depth(client, s.prompt, s.context_span, o) for o in s.needle_offsets]
    assert len(depths) == (5 if task == "vt" else 4)
    assert depths == sorted(depths)
    assert max(depths) - min(depths) <= 30
    assert abs(sum(depths) / len(depths) - depth) <= 8, depths
    if task == "vt":  # the chain is in order: VAR a = value, VAR b = VAR a, ...
        names = s.expected
        assert s.prompt[s.needle_offsets[0]:].startswith(f"VAR {names[0]} = ")
        for prev, name, off in zip(names, names[1:], s.needle_offsets[1:], strict=False):
            assert s.prompt[off:].startswith(f"VAR {name} = VAR {prev}.")


def test_niah_answers_are_in_the_context_once(client: EvalClient) -> None:
    single = fit_sample("niah_multikey", 1500, 50, 2, 11, client.count_tokens)
    context = single.prompt[slice(*single.context_span)]
    assert context.count(single.expected[0]) == 1
    assert context.count("One of the special magic numbers for ") == 4  # target + 3 distractor keys
    asked = re.search(r"special magic number for (\S+) mentioned", single.prompt).group(1)
    assert f"for {asked} is: {single.expected[0]}." in context
    multi = fit_sample("niah_multivalue", 1500, 50, 2, 11, client.count_tokens)
    assert all(multi.prompt.count(v) == 1 for v in multi.expected) and len(set(multi.expected)) == 4


@pytest.mark.parametrize("n_decoys", [4, 8, 16])
def test_decoys_name_the_key_without_the_value(client: EvalClient, n_decoys: int) -> None:
    s = fit_sample(f"niah_decoy{n_decoys}", 3000, 50, 0, 5, client.count_tokens)
    context = s.prompt[slice(*s.context_span)]
    key = re.search(r"special magic number for (\S+) mentioned", s.prompt).group(1)
    assert context.count(s.expected[0]) == 1 and len(s.needle_offsets) == 1  # one needle holds the value
    assert context.count(key) == n_decoys + 1  # the key recurs in every decoy
    decoys = [m.start() for m in re.finditer(re.escape(key), context)]
    depths = sorted(token_depth(client, s.prompt, s.context_span, s.context_span[0] + d) for d in decoys)
    assert depths[-1] - depths[0] > 60  # spread over the haystack, not clustered at the needle
    assert abs(token_depth(client, s.prompt, s.context_span, s.needle_offsets[0]) - 50) <= 4


def test_two_hop_answer_needs_both_statements(client: EvalClient) -> None:
    s = fit_sample("niah_twohop", 3000, 20, 0, 5, client.count_tokens)
    first, second = (s.prompt[o:o + 120] for o in s.needle_offsets)
    label = re.search(r"card labelled (\w+)\.", first).group(1)
    key = re.search(r"special magic number for (\S+) is written", first).group(1)
    assert second.startswith(f"The card labelled {label} reads: {s.expected[0]}.")
    assert key in s.prompt[-300:] and label not in s.prompt[-300:]  # the question names the key only
    depths = [token_depth(client, s.prompt, s.context_span, o) for o in s.needle_offsets]
    assert abs(depths[0] - 20) <= 4 and abs(depths[1] - 70) <= 4  # half the context apart
    assert len(s.answer_offsets) == 2  # the hit rate wants both blocks


def test_cwe_common_words_are_the_most_frequent(client: EvalClient) -> None:
    s = fit_sample("cwe", 3000, None, 0, 5, client.count_tokens)
    assert s.depth is None
    words = re.findall(r"\d+\. (\S+)", s.prompt[slice(*s.context_span)])
    counts = Counter(words)
    f_common, f_other = _cwe_frequencies(3000)
    assert all(counts[w] == f_common for w in s.expected)
    assert max(c for w, c in counts.items() if w not in s.expected) <= f_other < f_common
    assert {w for w, _ in counts.most_common(10)} == set(s.expected)
    assert s.answer_pool == set(words)  # what cwe scoring picks answers from
    question = s.prompt[s.context_span[1]:] + s.prompt[:s.context_span[0]]
    assert not set(re.findall(r"[a-z]+", question.lower())) & s.answer_pool  # no instruction word is a list word


def test_samples_are_seeded(client: EvalClient) -> None:
    a = fit_sample("niah_single_essay", 1000, 50, 0, 42, client.count_tokens)
    b = fit_sample("niah_single_essay", 1000, 50, 0, 42, client.count_tokens)
    c = fit_sample("niah_single_essay", 1000, 50, 0, 43, client.count_tokens)
    d = fit_sample("niah_single_essay", 1000, 50, 1, 42, client.count_tokens)
    assert a.prompt == b.prompt and a.expected == b.expected
    assert c.prompt != a.prompt and d.prompt != a.prompt


def test_prompt_without_room_is_a_user_error(client: EvalClient) -> None:
    from kvmem_llama.errors import KvmemError

    with pytest.raises(KvmemError, match="without any haystack"):
        fit_sample("niah_multiquery", 50, 50, 0, 0, client.count_tokens)


def test_depths_of_one_sample_share_the_haystack(client: EvalClient) -> None:
    deep = fit_sample("niah_single_essay", 1500, 90, 0, 5, client.count_tokens)
    mid = fit_sample("niah_single_essay", 1500, 50, 0, 5, client.count_tokens)
    assert deep.expected == mid.expected  # same key and value, only the needle moves
    cut = mid.needle_offsets[0]
    assert deep.prompt[:cut] == mid.prompt[:cut]


@pytest.mark.parametrize("depth", [5, 50, 95])
def test_followup_needle_sits_in_document_b(client: EvalClient, depth: int) -> None:
    s = fit_sample("niah_followup", 1500, depth, 0, 3, client.count_tokens)
    (first,) = s.history
    assert s.history_max_tokens == 16
    assert "special magic number" not in first.split("\n", 1)[1]  # document A holds no needle
    (offset,) = s.needle_offsets
    assert s.prompt[offset:].startswith("One of the special magic numbers for ")
    assert s.prompt[s.answer_offsets[0]:].startswith(s.expected[0])
    # document A is about 45% of the haystack, document B the rest; the depth is B's
    a_tokens = client.count_tokens(first)
    b_tokens = client.count_tokens(s.prompt[slice(*s.context_span)])
    assert abs(a_tokens / (a_tokens + b_tokens) - FOLLOWUP_SHARE_A) < 0.05
    assert abs(token_depth(client, s.prompt, s.context_span, offset) - depth) <= 3.0
    assert 1500 - 10 <= s.tokens <= 1500
    # every depth of one sample shares both documents (the hint refits in a probe or two)
    other = fit_sample("niah_followup", 1500, 50 if depth != 50 else 5, 0, 3, client.count_tokens, hint=s.units)
    assert other.history == s.history and other.expected == s.expected and other.units == s.units


@pytest.mark.parametrize("task", ["niah_single_essay", "niah_multivalue", "vt", "niah_followup"])
def test_answer_positions_are_the_server_tokens_of_the_answers(client: EvalClient, task: str,
                                                                tmp_path: Path) -> None:
    """The token index found for each answer is the token of the server's chat prompt that starts it."""
    s = fit_sample(task, 1200, 50, 0, 1, client.count_tokens)
    messages = [m for turn in s.history for m in ({"role": "user", "content": turn},
                                                  {"role": "assistant", "content": "OK."})]
    messages.append({"role": "user", "content": s.prompt})
    positions = Evaluation(Plan([task], [1200], [50], 1, 1), tmp_path).answer_positions(client, messages, s)
    assert positions is not None and len(positions) == len(s.answer_offsets) == len(s.expected)
    assert positions == sorted(positions)
    # the prompt as llama-server tokenizes a chat request: special tokens added and parsed
    rendered = client.apply_template(messages)
    assert rendered is not None and rendered.count(s.prompt) == 1
    tokens = client._http.post(f"{client.root}/tokenize", json={"content": rendered, "add_special": True,
                                                                "with_pieces": True}).json()["tokens"]
    for pos, value in zip(positions, s.expected, strict=True):
        piece = tokens[pos]["piece"].strip()
        assert piece and value.startswith(piece), (pos, tokens[pos], value)
        assert "".join(t["piece"] for t in tokens[pos:pos + 8]).strip().startswith(value)
