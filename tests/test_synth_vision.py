"""Synthetic mmproj GGUFs (kvmem_llama.synth_vision): written with gguf, read back, and loaded by the built
engine's llama-server with `--mmproj` next to the tiny synthetic qwen35 text model; images go through the
official `openai` client as `image_url` data URIs. Random weights: the answers are noise, the checks are
mechanics (the file loads, an image becomes the expected number of tokens, runs are repeatable, the image
reaches the model)."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import numpy as np
import openai
import pytest
from gguf import GGUFReader

from kvmem_llama import synth
from kvmem_llama.synth_vision import PRESETS, PROJECTOR_TYPE, make_vision_plan, synthesize_mmproj
from kvmem_llama.synth_vision import synthetic_png as png

TEXT_N_EMBD = synth.preset_shape("qwen35", "tiny").n_embd
SERVER_ARGS = ["--kvmem-budget", "0", "-c", "4096", "-np", "1"]
QUESTION = "What is in this picture?"


def data_uri(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", timeout=120, max_retries=0)


def ask(cli: openai.OpenAI, image: bytes | None, text: str = QUESTION, **extra):
    content: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": data_uri(image)}})
    return cli.chat.completions.create(model="any", messages=[{"role": "user", "content": content}],
                                       max_tokens=8, temperature=0, **extra)


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory) -> Path:
    return synthesize_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf", text_n_embd=TEXT_N_EMBD, seed=3)


# --- the file (no engine) ------------------------------------------------------------------------------------------

def test_mmproj_file_reads_back_with_the_loader_keys_and_shapes(mmproj: Path, tmp_path: Path) -> None:
    reader = GGUFReader(mmproj)
    meta = {k: synth._field_value(f) for k, f in reader.fields.items()}
    shape = PRESETS["tiny"]
    assert meta["general.type"] == "mmproj"
    assert meta["clip.projector_type"] == PROJECTOR_TYPE == "qwen3vl_merger"
    assert meta["clip.has_vision_encoder"] is True and meta["clip.use_gelu"] is True
    assert meta["clip.vision.projection_dim"] == TEXT_N_EMBD
    assert meta["clip.vision.embedding_length"] == shape.n_embd
    assert meta["clip.vision.block_count"] == shape.n_layer
    assert meta["clip.vision.spatial_merge_size"] == 2
    assert meta["clip.vision.image_mean"] == pytest.approx([0.5] * 3)

    plan = {t.name: t for t in make_vision_plan(shape, TEXT_N_EMBD)}
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(plan)
    for name, t in tensors.items():
        assert tuple(int(n) for n in t.shape) == plan[name].ne, name
        assert np.isfinite(np.asarray(t.data, dtype=np.float32)).all(), name
    assert tuple(tensors["mm.2.bias"].shape) == (TEXT_N_EMBD,)  # what mtmd checks against the text model
    n_pos = int(tensors["v.position_embd.weight"].shape[1])
    assert n_pos == (shape.image_size // shape.patch_size) ** 2 == math.isqrt(n_pos) ** 2  # a square grid

    # the bytes depend on the seed only; no .part file is left behind
    again = synthesize_mmproj(tmp_path / "again.gguf", text_n_embd=TEXT_N_EMBD, seed=3)
    assert again.read_bytes() == mmproj.read_bytes()
    assert not list(tmp_path.glob("*.part"))


def test_image_token_count_follows_the_preprocessor() -> None:
    shape = PRESETS["tiny"]
    assert shape.image_grid(64, 64) == (96, 96)  # scaled up to the minimum of 8 tokens, 32-pixel aligned
    assert shape.n_image_tokens(64, 64) == 9
    assert shape.n_image_tokens(300, 100) == 27


# --- the engine ----------------------------------------------------------------------------------------------------

@pytest.mark.engine
def test_llama_server_loads_the_mmproj_and_counts_image_tokens(llama_server, qwen35, mmproj) -> None:
    """llama-server loads the projector next to the qwen35 text model and answers image requests; each image
    adds its tokens (patches merged 2x2) plus <|vision_start|> and <|vision_end|> to the prompt."""
    with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), *SERVER_ARGS]) as srv:
        cli = client(srv.url)
        text_only = ask(cli, None)
        answers = {size: ask(cli, png(*size)) for size in [(64, 64), (300, 100)]}
        log = srv.log()
    assert "loaded multimodal model" in log
    assert text_only.usage.completion_tokens >= 1
    for (w, h), r in answers.items():
        assert r.choices[0].message.content, (w, h)
        assert r.usage.completion_tokens >= 1
        n_img = PRESETS["tiny"].n_image_tokens(w, h)
        extra = r.usage.prompt_tokens - text_only.usage.prompt_tokens
        assert extra >= n_img, (w, h, extra)
        assert extra == n_img + 2, (w, h, extra)  # + <|vision_start|> and <|vision_end|>


@pytest.mark.engine
def test_image_requests_are_deterministic_and_the_image_reaches_the_model(llama_server, qwen35, mmproj) -> None:
    """The same image twice (prompt cache off: encoded twice) gives the same tokens and logprobs; another
    image gives other logprobs, so the projector's embeddings reach the text model (and are finite)."""
    no_cache = {"extra_body": {"cache_prompt": False}, "logprobs": True, "top_logprobs": 3}
    with llama_server(qwen35["plain"], ["--mmproj", str(mmproj), *SERVER_ARGS]) as srv:
        cli = client(srv.url)
        first = ask(cli, png(64, 64), **no_cache)
        second = ask(cli, png(64, 64), **no_cache)
        other = ask(cli, png(64, 64, seed=5), **no_cache)

    def tokens(r) -> list[tuple[str, float]]:
        return [(t.token, t.logprob) for t in r.choices[0].logprobs.content]

    assert first.choices[0].message.content == second.choices[0].message.content
    assert tokens(first) == tokens(second)
    assert len(tokens(first)) == first.usage.completion_tokens >= 1
    assert all(math.isfinite(lp) for _, lp in tokens(first))
    first_top = [(t.token, t.logprob) for t in first.choices[0].logprobs.content[0].top_logprobs]
    other_top = [(t.token, t.logprob) for t in other.choices[0].logprobs.content[0].top_logprobs]
    assert first_top != other_top
