"""KV tiering in the real engine (issue 3): real llama-server processes and the cffi binding on CPU.

Model: SmolLM2-135M-Instruct (llama arch). With full KV it finds a 7-digit needle in a ~7.2K-token
haystack at depths 10/50/90 % (checked by test_needle_full_kv_baseline), so it is the model of the
retrieval tests. The KV-tiering flags under test are the `--kvmem-*` flags of llama-server.
"""

from __future__ import annotations

import random
import re
import subprocess

import httpx
import pytest

from kvmem_llama import kvmem_log
from kvmem_llama.binding import KvmemConfig, Llama
from kvmem_llama.engine import Engine
from kvmem_llama.shipped import shipped_model_path

pytestmark = pytest.mark.engine

# small blocks so that a CPU-sized prompt spans many of them
SMALL = ["--kvmem-block", "64", "--kvmem-sink", "64", "--kvmem-recent", "128", "--kvmem-gen-reserve", "128"]
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]


def haystack_prompt(n_sentences: int, depth: float, key: str, value: str) -> str:
    sentences = [FILLER[i % len(FILLER)] for i in range(n_sentences)]
    sentences.insert(int(n_sentences * depth), f"The secret code for {key} is {value}. Remember it.")
    user = " ".join(sentences) + f"\n\nWhat is the secret code for {key}? Answer with the number only."
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\nThe secret code for {key} is"


def essay(n_sentences: int) -> str:
    rng = random.Random(1234)
    words = "river stone light window garden music paper engine winter market bridge forest signal".split()
    return " ".join(
        f"In chapter {i} the {rng.choice(words)} met the {rng.choice(words)} near the {rng.choice(words)}."
        for i in range(n_sentences)
    )


def complete(url: str, prompt: str | list[int], n_predict: int = 16, timeout: float = 600.0, **extra) -> dict:
    resp = httpx.post(f"{url}/completion", json={
        "prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1, "cache_prompt": False,
        "return_tokens": True, **extra,
    }, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def kvmem_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^llamacpp:(kvmem_\w+) (\S+)$", text, re.M)}


def test_identity_when_budget_covers_the_context(llama_server, smollm2) -> None:
    """budget >= context: nothing is ever evicted, greedy output must be token-identical to tiering off."""
    prompt = essay(260) + "\nSummary of the story:"
    base = ["-c", "4096", "-np", "1", "-fa", "on", "--metrics"]
    with llama_server(smollm2, base) as srv:
        ref = complete(srv.url, prompt, n_predict=32)
    with llama_server(smollm2, [*base, "--kvmem-budget", "4096", *SMALL]) as srv:
        got = complete(srv.url, prompt, n_predict=32)
        log = srv.log()
    assert 2000 < ref["tokens_evaluated"] < 4000
    assert got["tokens"] == ref["tokens"], (got["content"], ref["content"])
    assert kvmem_log.selects(log), "tiering was on, a SELECT line was expected"
    assert all(s["staged_in"] == 0 for s in kvmem_log.selects(log))


def test_identity_with_a_quantized_pool_when_budget_covers_the_context(llama_server, smollm2) -> None:
    """With -ctk/-ctv q8_0 and budget >= context: --kvmem-gpu-type same is token-identical to tiering off
    with q8_0; f16 (the default) to tiering off with f16, since attention only reads the working set and
    nothing comes back from the pool."""
    prompt = essay(260) + "\nSummary of the story:"
    base = ["-c", "4096", "-np", "1", "-fa", "on"]
    q8 = ["-ctk", "q8_0", "-ctv", "q8_0"]
    tiered = ["--kvmem-budget", "4096", *SMALL]
    runs = {}
    for name, args in [("off_q8", q8), ("off_f16", []), ("same", [*q8, *tiered, "--kvmem-gpu-type", "same"]),
                       ("f16", [*q8, *tiered])]:
        with llama_server(smollm2, [*base, *args]) as srv:
            runs[name] = complete(srv.url, prompt, n_predict=32)["tokens"]
    assert runs["same"] == runs["off_q8"]
    assert runs["f16"] == runs["off_f16"]


def test_prompt_of_8x_the_budget_completes_with_logs_metrics_props_slots(llama_server, smollm2) -> None:
    prompt = essay(420) + "\nSummary of the story:"
    args = ["-c", "8192", "-np", "1", "--metrics", "--slots", "--kvmem-budget", "512", *SMALL]
    with llama_server(smollm2, args) as srv:
        before = kvmem_metrics(srv.url)
        out = complete(srv.url, prompt, n_predict=16)
        after = kvmem_metrics(srv.url)
        props = httpx.get(f"{srv.url}/props", timeout=30).json()
        slots = httpx.get(f"{srv.url}/slots", timeout=30).json()
        log = srv.log()
    assert out["tokens_evaluated"] >= 8 * 512
    assert out["tokens_predicted"] > 0

    armed = [e for e in kvmem_log.iter_events(log) if e["event"] == "ARMED"]
    assert len(armed) == 1 and armed[0]["block_tokens"] == 64 and armed[0]["budget_blocks"] == 8
    assert armed[0]["layers"] == 30 and armed[0]["kv_heads"] == 3 and armed[0]["head_dim"] == 64
    sel = kvmem_log.selects(log)
    assert sel, log[-3000:]
    assert sel[-1]["n_blocks"] >= out["tokens_evaluated"] // 64 - 1
    assert sel[-1]["sink"] == 1 and sel[-1]["recent"] == 2 and sel[-1]["query_tokens"] == 128
    assert sel[-1]["reason"] == "turn" and sel[-1]["method"] == "hybrid"  # retrieval = the default scorer
    assert sel[-1]["sink"] + sel[-1]["recent"] + sel[-1]["scored"] <= 8

    assert after["kvmem_selections_total"] > before.get("kvmem_selections_total", 0)
    assert after["kvmem_blocks_evicted_total"] > 0
    assert after["kvmem_blocks_host"] >= out["tokens_evaluated"] // 64 - 1
    assert after["kvmem_host_bytes"] > 0
    assert after["kvmem_budget_tokens"] == 512
    assert props["kvmem"]["enabled"] is True and props["kvmem"]["budget"] == 512
    assert props["kvmem"]["method"] == "retrieval" and props["kvmem"]["prefill"] == "window"
    assert slots[0]["kvmem"]["blocks_host"] >= 60 and slots[0]["kvmem"]["selections"] >= 1


def test_tiering_off_by_default_and_metrics_stay_upstream(llama_server, smollm2) -> None:
    with llama_server(smollm2, ["-c", "2048", "-np", "1", "--metrics"]) as srv:
        complete(srv.url, "Hello", n_predict=4)
        metrics = kvmem_metrics(srv.url)
        props = httpx.get(f"{srv.url}/props", timeout=30).json()
        log = srv.log()
    assert metrics == {}
    assert props["kvmem"]["enabled"] is False
    assert "kvmem_score:" not in log


@pytest.mark.parametrize(("cache_type", "gpu_type"), [("q8_0", "f16"), ("q5_0", "f16"), ("q5_0", "same")])
def test_quantized_kv_with_tiering_answers(llama_server, smollm2, cache_type: str, gpu_type: str) -> None:
    """-ctk/-ctv set the host pool's type; the working set is f16 (stage-in dequantizes, write-through
    quantizes) or the pool's type (rows copied byte for byte). Most of the prompt is evicted during prefill,
    the selection stages blocks back in, the turn's tail is recomputed, the answer stays right. (The needle
    sits just before the question, so this checks the data path, not retrieval.)"""
    prompt = haystack_prompt(600, 0.97, "Orion", "4417093")
    args = ["-c", "4096", "-np", "1", "--metrics", "-ctk", cache_type, "-ctv", cache_type,
            "--kvmem-budget", "640", *SMALL, "--kvmem-gpu-type", gpu_type]
    with llama_server(smollm2, args) as srv:
        out = complete(srv.url, prompt, n_predict=12)
        metrics = kvmem_metrics(srv.url)
        props = httpx.get(f"{srv.url}/props", timeout=30).json()["kvmem"]
        log = srv.log()
    armed = kvmem_log.armed(log)
    working = "f16" if gpu_type == "f16" else cache_type
    assert (armed["gpu_type"], armed["pool_type"]) == (f"{working}/{working}", f"{cache_type}/{cache_type}")
    assert props["gpu_type"] == gpu_type
    f16_row = armed["kv_heads"] * armed["head_dim"] * 2  # bytes of one K or V row in f16
    f16_pool_mib = armed["blocks"] * armed["block_tokens"] * armed["layers"] * 2 * f16_row / 2**20
    assert armed["host_mib"] < 0.6 * f16_pool_mib, (armed, f16_pool_mib)  # the history is stored quantized
    assert out["tokens_evaluated"] > 4 * 640
    assert kvmem_log.selects(log)
    assert metrics["kvmem_blocks_evicted_total"] > 0 and metrics["kvmem_blocks_staged_in_total"] > 0
    assert "4417093" in out["content"].replace(",", ""), out["content"]


def test_deep_needle_comes_back_from_a_q8_pool_into_an_f16_working_set(llama_server, smollm2) -> None:
    """A needle a fifth into a prompt 4x the budget is evicted during prefill: the answer needs its block
    dequantized from the q8_0 pool. The f16 working set and the q8_0 one see the same blocks and answer alike."""
    prompt = haystack_prompt(600, 0.2, "ZEBRA", "48213")
    base = ["-c", "4096", "-np", "1", "-ctk", "q8_0", "-ctv", "q8_0", "--kvmem-budget", "1024", *SMALL]
    answers, staged = {}, {}
    for gpu_type in ("f16", "same"):
        with llama_server(smollm2, [*base, "--kvmem-gpu-type", gpu_type]) as srv:
            answers[gpu_type] = complete(srv.url, prompt, n_predict=8)["content"]
            staged[gpu_type] = [s["staged_in"] for s in kvmem_log.selects(srv.log())]
    assert "48213" in answers["f16"], answers
    assert answers["f16"] == answers["same"], answers
    assert staged["f16"] == staged["same"] and staged["f16"][-1] > 0, staged


def test_host_pool_too_small_is_a_request_error_and_the_server_stays_up(llama_server, smollm2) -> None:
    # SmolLM2 f16 KV: 30 layers x 2 x 384 B x 32 tokens = 720 KiB per block -> 2 MiB hold 2 blocks
    args = ["-c", "4096", "-np", "1", "--kvmem-budget", "256", "--kvmem-block", "32", "--kvmem-sink", "32",
            "--kvmem-recent", "64", "--kvmem-host-mib", "2"]
    with llama_server(smollm2, args) as srv:
        resp = httpx.post(f"{srv.url}/completion", json={"prompt": essay(60), "n_predict": 4}, timeout=300)
        assert resp.status_code >= 400
        assert "--kvmem-host-mib" in resp.text
        small = complete(srv.url, "The capital of France is", n_predict=4)
        assert small["tokens_predicted"] > 0
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_invalid_flags_are_rejected_at_startup(cpu_engine: Engine, smollm2) -> None:
    for flags, needle in [
        (["--kvmem-budget", "256"], "--kvmem-budget 256 is too small"),
        (["--kvmem-budget", "1024", "--kvmem-method", "best"], "--kvmem-method must be one of retrieval, recency"),
        (["--kvmem-budget", "1024", "--kvmem-prefill", "all"], "--kvmem-prefill must be window or retrieval"),
        (["--kvmem-budget", "1024", "--kvmem-gpu-type", "bf16"], "--kvmem-gpu-type must be f16 or same"),
        (["--kvmem-budget", "1024", "-fa", "off"], "needs flash attention"),
    ]:
        proc = subprocess.run([str(cpu_engine.server), "-m", str(smollm2), *flags], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0
        assert needle in proc.stdout + proc.stderr


def test_models_that_cannot_be_tiered_say_disabled(llama_server) -> None:
    gemma = shipped_model_path("gemma3:270m")  # iSWA memory: not tiered yet
    with llama_server(gemma, ["-c", "2048", "-np", "1", "--kvmem-budget", "1024"]) as srv:
        out = complete(srv.url, "The capital of France is", n_predict=4)
        log = srv.log()
    assert out["tokens_predicted"] > 0
    assert kvmem_log.tiering_state(log) == "disabled" or "kvmem_score: DISABLED (" in log


def test_binding_reads_kvmem_stats(cpu_engine: Engine, smollm2) -> None:
    cfg = KvmemConfig(budget=512, block=64, sink=64, recent=128, gen_reserve=128)
    with Llama.load(smollm2, n_ctx=8192, n_batch=8192, libllama=cpu_engine.libllama, kvmem=cfg) as llm:
        tokens = llm.tokenize(essay(300))
        assert len(tokens) > 6 * 512
        llm.decode(tokens, n_batch=len(tokens))
        stats = llm.kvmem_stats()
        seq0 = llm.kvmem_stats(seq_id=0)
    assert stats.enabled and stats.budget == 512 and stats.block_tokens == 64
    assert stats.blocks_host == len(tokens) // 64
    assert 0 < stats.blocks_gpu <= 512 // 64
    assert stats.selections == 1 and stats.evicted > 0 and stats.staged_in >= 0
    assert stats.host_bytes > 0 and stats.host_capacity_bytes >= stats.host_bytes
    assert seq0.blocks_host == stats.blocks_host and seq0.selections == 1
    with Llama.load(smollm2, n_ctx=1024, libllama=cpu_engine.libllama) as plain:
        assert plain.kvmem_stats().enabled is False


@pytest.mark.slow
def test_defaults_live_in_the_engine_and_agree(cpu_engine: Engine, smollm2, llama_server) -> None:
    """One place for the tiering defaults (llama-kvmem-params.h): the binding's llama_context_default_params,
    llama-server's --help and its /props say the same, and the Python side reads them from there."""
    from kvmem_llama.binding import engine_kvmem_defaults, load_library
    from kvmem_llama.serving import argv

    lib = load_library(cpu_engine.libllama)
    binding = engine_kvmem_defaults(lib)
    helped = argv.kvmem_defaults(argv.engine_help(cpu_engine))
    with llama_server(smollm2, ["-c", "1024", "-np", "1"]) as srv:
        props = httpx.get(f"{srv.url}/props", timeout=30).json()["kvmem"]
    sizes = ("block", "sink", "recent", "gen_reserve", "query_tokens", "refresh", "host_mib")
    for name in sizes:
        assert binding[name] == props[name], name
        assert helped[f"--kvmem-{name.replace('_', '-')}"] == binding[name], name
    assert props["method"] == lib_method_name(lib, binding["method"]) == "retrieval"
    assert binding["budget"] == props["budget"] == 0 and not props["enabled"]
    assert {"window": 0, "retrieval": 1}[props["prefill"]] == binding["prefill"]
    assert {"f16": 0, "same": 1}[props["gpu_type"]] == binding["gpu_type"]
    # the parallel-slot warning counts with these (a -np 4 server at budget 1024 serves fewer slots at once)
    assert argv.parallel_tiering_warning(["-np", "4"], 1024, helped)


def lib_method_name(lib, method: int) -> str:
    from kvmem_llama.binding import ffi

    return ffi.string(lib.llama_kvmem_method_name(method)).decode()


def test_nothing_is_selected_while_the_history_fits(llama_server, smollm2) -> None:
    """While every block of the history is resident and the share holds it, turns and refreshes are no-ops:
    a SELECT line that says fits=1, nothing scored, nothing staged, 0 ms (issue 24)."""
    args = ["-c", "4096", "-np", "1", "--kvmem-budget", "3072", *SMALL, "--kvmem-refresh", "16"]
    with llama_server(smollm2, args) as srv:
        out = complete(srv.url, haystack_prompt(120, 0.5, "Oslo", "4417"), n_predict=40, ignore_eos=True)
        log = srv.log()
    selects = kvmem_log.selects(log)
    assert out["tokens_evaluated"] > 4 * 64 and selects
    assert {s["reason"] for s in selects} >= {"turn", "refresh"}
    for s in selects:
        assert (s.get("fits"), s["scored"], s["staged_in"], s["staged_out"], s["ms"]) == (1, 0, 0, 0, 0.0), s
        # the time since the previous line is broken down as on a scored line: the passes, the captures inside them
        assert 1 <= s["decodes"] <= s["capture_ubatches"], s
        assert s["capture_fetch_ms"] + s["capture_write_ms"] <= s["capture_ms"] + 0.01, s
        assert s["capture_ms"] <= s["decode_ms"] + 0.01, s
