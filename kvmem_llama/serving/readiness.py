"""Readiness checks that need no running process: the tiering self-test's prompt and its verdict
(a needle in filler longer than the budget; the answer and the log must show a retrieval), and the
warning for a server that listens beyond loopback without an API key. ServerProcess.wait_ready
(serving.process) sends the prompt and judges the answer with these.
"""

from __future__ import annotations

import random

from kvmem_llama import kvmem_log
from kvmem_llama.net import is_loopback


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The warning for a server that listens beyond loopback without an API key (None otherwise)."""
    if api_key or is_loopback(host) or host.endswith(".sock"):  # llama-server takes a *.sock host as a unix socket
        return None
    where = "every network interface" if host in ("0.0.0.0", "::", "") else host
    return (f"--host {host} listens on {where} and no --api-key is set: anyone who can reach port {port} can use "
            "the API unauthenticated (completions, /slots, /metrics); pass --api-key KEY (clients send "
            "'Authorization: Bearer KEY') or keep --host 127.0.0.1")


# --- the tiering self-test ---

NEEDLE_FILLER = (
    "The archive room held shelves of ledgers about grain, weather and river tolls.",
    "Clerks copied each entry twice so that a flood could never erase the record.",
    "Visitors signed a book at the door and left their lanterns on a stone bench.",
    "Every autumn the council audited the tolls and argued about the bridge repairs.",
)


def self_test_prompt(budget: int, seed: int | None = None) -> tuple[str, str]:
    """(prompt, expected answer): a needle in filler about 1.5x the budget in tokens (~16 tokens a sentence).

    The same budget gives the same prompt (seed: the budget): a start's outcome must not hang on a random draw.
    With a random code, SmolLM2-135M copied one code wrong (9566 for 9556) in a CI run, and the start failed.
    """
    rng = random.Random(budget if seed is None else seed)
    code = str(rng.randint(1000, 9999))
    sentences = max(8, int(budget * 1.5 / 16))
    lines = [NEEDLE_FILLER[i % len(NEEDLE_FILLER)] for i in range(sentences)]
    lines.insert(max(1, sentences // 4), f"Remember this: the vault code is {code}.")
    question = "\n\nQuestion: what is the vault code? Answer with the four digits only."
    return " ".join(lines) + question, code


def check_self_test(answer: str, expected: str, log_text: str) -> tuple[bool, str]:
    """Did the needle come back, and did the engine log a retrieval (SELECT with scored blocks)?"""
    picks = kvmem_log.selects(log_text)
    state = kvmem_log.tiering_state(log_text)
    if state.startswith("disabled"):
        return False, f"the engine turned tiering off ({state.split(': ', 1)[1]})"
    if not picks:
        return False, "no `kvmem_score: SELECT` line appeared in the log for the self-test prompt"
    if expected not in answer:
        return False, f"the self-test answer {answer.strip()[:80]!r} does not contain the needle {expected}"
    last = picks[-1]
    return True, (f"needle found; SELECT n_blocks={last['n_blocks']} budget_blocks={last['budget_blocks']} "
                  f"staged_in={last['staged_in']} ms={last['ms']:g}")
