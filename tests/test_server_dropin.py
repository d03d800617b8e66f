"""Drop-in behaviour of our llama-server next to upstream's (issue 16): 404 bodies, and tiering that was
asked for but could not arm (real server processes on the CPU engine, SmolLM2-135M)."""

from __future__ import annotations

import httpx
import pytest

from kvmem_llama import kvmem_log

pytestmark = pytest.mark.engine

CACHE_RAM_OFF = "prompt cache (--cache-ram) disabled while KV tiering is on"


def test_404_bodies_are_upstreams_except_for_a_wrong_model_id(llama_server, smollm2) -> None:
    args = ["-c", "2048", "-np", "1", "--tools", "get_info", "--strict-model-id"]
    with llama_server(smollm2, args) as srv:
        route = httpx.get(f"{srv.url}/no-such-route", timeout=30)
        tool = httpx.post(f"{srv.url}/tools", json={"tool": "no_such_tool"}, timeout=30)
        model = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for reply in (route, tool):  # upstream's standard body for every 404 a handler or the router gives
        assert reply.status_code == 404
        assert reply.json() == {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
    assert model.status_code == 404
    error = model.json()["error"]
    assert error["type"] == "not_found_error" and "gpt-4o" in error["message"] and "serves" in error["message"]


@pytest.mark.parametrize("parallel", [1, 2])
def test_props_and_prompt_cache_follow_whether_tiering_armed(llama_server, smollm2, parallel: int) -> None:
    """-np 2 without --kv-unified cannot be tiered: the engine says DISABLED, /props says tiering is off and
    the prompt cache stays on, as upstream. -np 1 arms: /props says on, the prompt cache is off (a saved slot
    state would hold only the working set)."""
    with llama_server(smollm2, ["-c", "4096", "-np", str(parallel), "--kvmem-budget", "1024"]) as srv:
        props = httpx.get(f"{srv.url}/props", timeout=30).json()["kvmem"]
        log = srv.log()
    armed = parallel == 1
    assert kvmem_log.tiering_state(log) == "armed" if armed else kvmem_log.tiering_state(log).startswith("disabled")
    assert props["enabled"] is armed
    assert (CACHE_RAM_OFF in log) is armed
