"""OpenAI compatibility of a server started like `kvmem run` (serving.launch), tested with the `openai` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvmem_llama import paths
from kvmem_llama.serving import argv
from kvmem_llama.serving.launch import ServerHandle, start_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def hermes_template() -> Path | None:
    """Qwen2.5's chat template (Hermes-style <tool_call> tags) from the pinned upstream tree.

    SmolLM2's own template has no tool syntax; with this one the server's tool-call parser applies.
    """
    for pattern in ("upstream/*/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja",
                    "trees/*/src/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"):
        found = sorted(paths.cache_dir().glob(pattern))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMEM_SERVERS_DIR", str(tmp_path_factory.mktemp("servers")))
    template = hermes_template()
    extra = ["--chat-template-file", str(template)] if template else []
    model = None if template else "qwen2.5-coder:0.5b"  # its own template has the same tool syntax
    try:
        with start_server(model, ctx=2048, mode="tool", extra_args=extra) as srv:
            yield srv
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", timeout=180, max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_models_list(client: openai.OpenAI, server: ServerHandle) -> None:
    assert [m.id for m in client.models.list()] == [server.model_id]


def test_stream_true(client: openai.OpenAI, server: ServerHandle) -> None:
    stream = client.chat.completions.create(model=server.model_id, messages=ask("Say hello."), stream=True,
                                            max_tokens=12, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and finishes in (["stop"], ["length"])
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 12 and usage.prompt_tokens > 0


def test_unknown_and_sampling_fields_tolerated(client: openai.OpenAI, server: ServerHandle) -> None:
    reply = client.chat.completions.create(
        model=server.model_id, messages=ask("Say hi."), max_tokens=6, temperature=0.3, top_p=0.5,
        parallel_tool_calls=False, user="test", seed=1,
        extra_body={"some_field_from_a_newer_api": {"x": 1}, "metadata": {"run": "compat"}})
    assert reply.choices[0].message.content and reply.model == server.model_id


def test_max_tokens_8192_accepted(client: openai.OpenAI, server: ServerHandle) -> None:
    # more than the 2048-token context: accepted, and generation ends by itself (stop sequences keep it short)
    reply = client.chat.completions.create(model=server.model_id, messages=ask("Say hello."), max_tokens=8192,
                                           stop=[".", "!", "?", "\n"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens < 200


def test_reasoning_effort_accepted(client: openai.OpenAI, server: ServerHandle) -> None:
    reply = client.chat.completions.create(model=server.model_id, messages=ask("Say hi."), max_tokens=6,
                                           reasoning_effort="low")
    assert reply.choices[0].message.content is not None


def test_wrong_model_id(client: openai.OpenAI, server: ServerHandle) -> None:
    help_text = argv.engine_help(server.engine)
    if argv.supports(help_text, "--strict-model-id"):
        assert "--strict-model-id" in server.argv  # kvmem run turns it on
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="gpt-4o", messages=ask("hi"), max_tokens=4)
        assert err.value.status_code == 404
        assert "gpt-4o" in str(err.value.body) and "not_found_error" in json.dumps(err.value.body)
    else:
        # today's engine (no strict-model-id patch yet) serves any name with its own model: pin that down
        reply = client.chat.completions.create(model="gpt-4o", messages=ask("hi"), max_tokens=4)
        assert reply.model == server.model_id
    # the served id (and an omitted model on the raw API) always works
    assert client.chat.completions.create(model=server.model_id, messages=ask("hi"), max_tokens=2).choices


def test_streaming_tool_calls_are_well_formed(client: openai.OpenAI, server: ServerHandle) -> None:
    # A 135M model does not decide to call tools on its own; the assistant turn is prefilled with the
    # opening of a <tool_call> so the model completes the arguments and the server's parser must turn
    # the streamed text into OpenAI tool_calls deltas.
    messages = [{"role": "system", "content": "You answer weather questions only by calling get_weather."}]
    for i, city in enumerate(("Berlin", "Rome")):  # two worked examples of the call syntax
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny, 20 C"},
                     {"role": "assistant", "content": f"It is sunny and 20 C in {city}."}]
    messages += [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'},
    ]
    stream = client.chat.completions.create(model=server.model_id, messages=messages, tools=TOOLS, stream=True,
                                            max_tokens=40, temperature=0)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "type": None, "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            entry["type"] = tc.type or entry["type"]
            if tc.function is not None:
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls", calls
    assert list(calls) == [0]
    call = calls[0]
    assert call["id"] and call["type"] == "function" and call["name"] == "get_weather"
    args = json.loads(call["arguments"])
    assert isinstance(args, dict) and isinstance(args.get("city"), str) and args["city"]
