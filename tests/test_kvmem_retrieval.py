"""Retrieval (issue 13): the scorers behind --kvmem-method and retrieval prefill, on real llama-server
processes (CPU, SmolLM2-135M). Whether a selection found the fact is read from the `resident` trace line:
the block holding the needle's value is resident after the turn's selection or not.

Accuracy with enough samples to rank the methods is measured by `kvmem eval` on the GPU (docs/eval);
these tests check the mechanics and that the default scorer finds needles recency cannot.
"""

from __future__ import annotations

import re

import pytest
from test_kvmem_engine import FILLER, SMALL, complete, haystack_prompt

from kvmem_llama import kvmem_log

pytestmark = pytest.mark.engine

# every scorer's ranking is a C++ unit test (tests/test_engine_units.py, suite score); here the flag reaches the
# engine and its lines for one method of each kind: the default, a bound method, and recency
METHODS = ("hybrid", "quest", "recency")


def value_block(url: str, prompt: str, value: str, block: int) -> int:
    """The block of the token where `value` starts, as the server tokenizes the prompt."""
    import httpx

    toks = httpx.post(f"{url}/tokenize", json={"content": prompt, "add_special": True, "with_pieces": True},
                      timeout=60).json()["tokens"]
    at = prompt.index(value)
    pos = 0
    for i, tok in enumerate(toks):
        piece = tok["piece"] if isinstance(tok["piece"], str) else ""
        if pos <= at < pos + max(1, len(piece)):
            return i // block
        pos += len(piece)
    raise AssertionError("value not found in the tokens")


def turn_resident(log: str) -> set[int]:
    return [r for r in kvmem_log.residents(log) if r["reason"] == "turn"][-1]["blocks"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_selects_and_says_its_name(llama_server, smollm2, method: str) -> None:
    prompt = haystack_prompt(300, 0.5, "Orion", "4417093")
    args = ["-c", "4096", "-np", "1", "--kvmem-budget", "512", *SMALL, "--kvmem-method", method, "--kvmem-trace"]
    with llama_server(smollm2, args) as srv:
        out = complete(srv.url, prompt, n_predict=4)
        log = srv.log()
    armed = [e for e in kvmem_log.iter_events(log) if e["event"] == "ARMED"][0]
    assert armed["method"] == method
    sel = [s for s in kvmem_log.selects(log) if s["reason"] == "turn"]
    assert len(sel) == 1 and sel[0]["method"] == method
    assert sel[0]["pos"] == out["tokens_evaluated"]
    scored = sel[0]["scored"]
    assert (scored == 0) if method == "recency" else (scored > 0), sel[0]
    resident = turn_resident(log)
    assert 0 in resident and len(resident) <= 512 // 64 - 1


@pytest.mark.slow
def test_the_default_scorer_keeps_the_needle_block_where_recency_cannot(llama_server, smollm2) -> None:
    """~3.6K-token haystacks, budget 512 in blocks of 64 (the sink, 2 recent blocks and 4 picks): after the
    turn the block holding the needle's value is resident at every depth with the default scorer; recency
    keeps only the newest blocks."""
    cases = [(0.1, "Orion", "4417093"), (0.4, "Falcon", "5550123"), (0.7, "Granite", "8061274")]
    found: dict[str, list[bool]] = {"retrieval": [], "recency": []}
    for method in found:
        args = ["-c", "4096", "-np", "1", "--kvmem-budget", "512", *SMALL, "--kvmem-method", method,
                "--kvmem-trace"]
        with llama_server(smollm2, args) as srv:
            for depth, key, value in cases:
                prompt = haystack_prompt(700, depth, key, value)
                mark = len(srv.log())
                complete(srv.url, prompt, n_predict=2)
                found[method].append(value_block(srv.url, prompt, value, 64) in turn_resident(srv.log()[mark:]))
    assert found["retrieval"] == [True, True, True], found
    assert found["recency"] == [False, False, False], found


def essay_sample(url: str, index: int):
    """A niah_single_essay sample of `kvmem eval` (7.8K tokens, the eval's seed 0), sized by the server."""
    import httpx

    from kvmem_llama.evaluation.tasks import fit_sample

    def count(text: str) -> int:
        return len(httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60).json()["tokens"])

    depth = (10, 30, 50, 70, 90)[index % 5]
    return fit_sample("niah_single_essay", 7800, depth, index, 0, count)


@pytest.mark.slow
def test_hybrid_keeps_a_fact_the_question_names_where_attention_points_elsewhere(llama_server, smollm2) -> None:
    """Essay haystacks where SmolLM2's own attention from the question ranks the needle's block far down (issue 13's
    finding; in a paired run `mass` alone keeps it in 76.7 % of 30 samples, hybrid in 96.7 %, docs/eval): the default
    scorer (retrieval = hybrid) takes every other pick from the blocks that share the question's rare words, so the
    needle's block is resident after the turn, and it came from the lexical side (the token ids decide that, not
    the CPU's floating point). The SELECT line says how many picks were lexical."""
    args = ["-c", "8192", "-np", "1", "--kvmem-budget", "1024", "--kvmem-trace"]
    with llama_server(smollm2, args, timeout=600) as srv:
        for index in (1, 2):
            sample = essay_sample(srv.url, index)
            mark = len(srv.log())
            complete(srv.url, sample.prompt, n_predict=2)
            log = srv.log()[mark:]
            block = value_block(srv.url, sample.prompt, sample.expected[0], 128)
            turn = [s for s in kvmem_log.selects(log) if s["reason"] == "turn"][-1]
            lexical = {int(m[1]) for m in re.finditer(r"kvmem_trace: pick seq=0 block=(\d+) \S+ lexical=1", log)}
            assert turn["method"] == "hybrid" and turn["lexical"] >= 1, turn
            assert block in turn_resident(log), (index, block, turn_resident(log))
            assert block in lexical, (index, block, lexical)


def test_hybrid_adds_no_lexical_picks_for_a_question_without_rare_words(llama_server, smollm2) -> None:
    """A question whose words are common in the haystack (or absent from it) gives no block that stands out:
    every pick comes from attention."""
    filler = " ".join(FILLER[i % len(FILLER)] for i in range(700))
    prompt = f"<|im_start|>user\n{filler}\n\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"
    args = ["-c", "4096", "-np", "1", "--kvmem-budget", "512", *SMALL, "--kvmem-trace"]
    with llama_server(smollm2, args) as srv:
        complete(srv.url, prompt, n_predict=2)
        log = srv.log()
    turn = [s for s in kvmem_log.selects(log) if s["reason"] == "turn"][-1]
    assert turn["method"] == "hybrid" and turn["scored"] > 0 and turn["lexical"] == 0, turn


def test_retrieval_prefill_selects_inside_the_prompt(llama_server, smollm2) -> None:
    """--kvmem-prefill retrieval: selections run inside the prompt every budget/4 tokens (whole blocks), each
    keeping picks to half of the working set, and the turn still selects once at the end."""
    prompt = haystack_prompt(700, 0.2, "Falcon", "5550123")
    args = ["-c", "4096", "-np", "1", "-b", "256", "-ub", "256", "--kvmem-budget", "1024", *SMALL,
            "--kvmem-prefill", "retrieval", "--kvmem-trace"]
    with llama_server(smollm2, args) as srv:
        out = complete(srv.url, prompt, n_predict=8)
        log = srv.log()
    sel = kvmem_log.selects(log)
    inside = [s for s in sel if s["reason"] == "prefill"]
    turns = [s for s in sel if s["reason"] == "turn"]
    assert len(turns) == 1 and turns[0]["pos"] == out["tokens_evaluated"]
    assert len(inside) >= out["tokens_evaluated"] // 256 - 2, [s["pos"] for s in inside]
    assert all(b["pos"] - a["pos"] >= 256 for a, b in zip(inside, inside[1:], strict=False))
    assert all(s["scored"] <= (1024 // 64 - 1) // 2 for s in inside), inside
    assert "5550123" in out["content"], out["content"]


@pytest.mark.parametrize("score_on", ["host", "device"])
def test_a_prompt_that_differs_deep_in_the_history_keeps_every_block_retrievable(llama_server, smollm2,
                                                                                   score_on) -> None:
    """The same haystack twice through the prompt cache, the needle moved from 90% to 30%: the server reuses the
    common prefix and cuts the cache inside a block whose first tokens' key rows are long gone. That block is
    summarized again when it completes (its old summary stands in for the unchanged tokens), so the needle in
    it is still found (it used to lose its summary and never be a candidate again). `mass` alone: the lexical
    picks of `hybrid` would find the needle's words without any summary. With the summaries on the scoring backend
    (`device`; the CPU backend here) the old summary is read back from there: it is the only copy."""
    import httpx

    def ask(url: str, depth: float) -> tuple[str, int]:
        prompt = haystack_prompt(700, depth, "Orion", "4417093")
        out = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0, "top_k": 1,
                                                    "cache_prompt": True}, timeout=600).json()
        return out, value_block(url, prompt, "4417093", 64)

    args = ["-c", "4096", "-np", "1", "--kvmem-budget", "512", *SMALL, "--kvmem-trace", "--kvmem-score-on", score_on,
            "--kvmem-method", "mass"]
    with llama_server(smollm2, args) as srv:
        ask(srv.url, 0.9)
        mark = len(srv.log())
        second, block = ask(srv.url, 0.3)
        log = srv.log()[mark:]
    assert second["timings"]["prompt_n"] < second["tokens_evaluated"] - 500  # the cache was reused
    assert block in turn_resident(log), (block, turn_resident(log))
    assert "4417093" in second["content"]
