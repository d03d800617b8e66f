"""benchmarks/numpy_llama.py, the numpy copy of SmolLM2 and Qwen2.5-Coder behind benchmarks/fidelity_probe.py and
benchmarks/ranking_probe.py, is the model the engine runs: the same next tokens as llama-server (llama's and qwen2's
RoPE, qwen2's biases and its own output matrix), and its partial recomputation agrees with its own full pass."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from numpy_llama import Llama  # noqa: E402

from kvmem_llama.shipped import shipped_model_path  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Tom has three apples and gives one to Anna. Now Tom has",
]


@pytest.fixture(scope="module")
def numpy_model(smollm2: Path) -> Llama:
    return Llama(str(smollm2))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_numpy_model_predicts_the_engines_next_tokens(arch, numpy_model, llama_server, smollm2):
    model = smollm2 if arch == "llama" else shipped_model_path("qwen2.5-coder:0.5b")
    numpy_model = numpy_model if arch == "llama" else Llama(str(model))
    with llama_server(model, ["-c", "512", "-np", "1"]) as srv:
        for prompt in PROMPTS:
            tokens = httpx.post(f"{srv.url}/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
            body = {"prompt": tokens, "n_predict": 4, "temperature": 0, "n_probs": 1, "cache_prompt": False}
            probs = httpx.post(f"{srv.url}/completion", json=body, timeout=120).json()["completion_probabilities"]
            engine = [p["id"] for p in probs]
            ours = list(tokens)
            for _ in range(4):  # greedy, one token at a time, as the server generated them
                x, _, _ = numpy_model.full(np.array(ours))
                ours.append(int(numpy_model.logits(x[-1:])[0].argmax()))
            assert ours[len(tokens):] == engine, prompt


def test_a_tail_recomputed_over_every_position_is_the_full_pass(numpy_model):
    tokens = np.arange(1000, 1300)
    x_full, Ks, Vs = numpy_model.full(tokens, chunk=64)
    t0 = 200
    x_tail = numpy_model.tail(tokens, t0, Ks, Vs, np.arange(t0))
    assert np.allclose(x_tail, x_full[t0:], atol=1e-3)
    # stand-ins weighted down to nothing change nothing; a subset of the positions does change the result
    n_kv, hd = Ks[0].shape[1:]

    def nothing(il):
        return np.ones((2, n_kv, hd), np.float32), np.ones((2, n_kv, hd), np.float32), np.full(2, -1e30, np.float32)

    assert np.allclose(numpy_model.tail(tokens, t0, Ks, Vs, np.arange(t0), nothing), x_tail, atol=1e-4)
    assert not np.allclose(numpy_model.tail(tokens, t0, Ks, Vs, np.arange(100, t0)), x_tail, atol=1e-2)
