"""Synthetic GGUFs: real files from kvmem_llama.synth, read back with gguf, loaded and run by the built engine."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvmem_llama import synth
from kvmem_llama.cli.synth import synth_cmd
from kvmem_llama.errors import KvmemError

TINY = [("llama", False), ("qwen3", False), ("qwen35", False), ("qwen35", True)]
TINY_IDS = ["llama", "qwen3", "qwen35", "qwen35-mtp"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """The four tiny presets, written once per module."""
    out = tmp_path_factory.mktemp("synth")
    paths = {}
    for (arch, mtp), name in zip(TINY, TINY_IDS, strict=True):
        paths[name] = synth.synthesize(out / f"{name}.gguf", arch, "tiny", mtp=mtp, quant="q4_k", seed=1).path
    return paths


def _meta(reader: GGUFReader, key: str):
    return synth._field_value(reader.fields[key])


# --- blocks and plans (no engine) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [synth.Q4_0, synth.Q4_K])
def test_quant_blocks_decode_to_sane_values(qtype: int) -> None:
    """gguf's own dequantizer reads our random blocks as finite, zero-mean values of the requested std."""
    rng = np.random.Generator(np.random.SFC64(7))
    std = 0.05
    blocks = synth._quant_blocks(rng, qtype, 4096, std)
    values = dequantize(blocks, GGMLQuantizationType(qtype)).reshape(-1)
    assert values.size == 4096 * synth.TYPE_SIZES[qtype][0]
    assert np.isfinite(values).all()
    assert abs(values.mean()) < 0.05 * std
    assert 0.9 * std < values.std() < 1.1 * std
    assert np.abs(values).max() < 10 * std


def test_tensor_chunks_stream_in_bounded_pieces() -> None:
    spec = synth.TensorSpec("x", (256, 4096), synth.Q4_K, "quant", 0.01)
    chunks = list(synth.tensor_chunks(spec, 0, chunk_bytes=100_000))
    assert len(chunks) > 5
    assert all(c.nbytes <= 100_000 for c in chunks)
    assert sum(c.nbytes for c in chunks) == spec.nbytes == 4096 * 144


def test_qwen35_27b_plan_has_the_real_shape() -> None:
    plan = synth.plan_for(None, "qwen35-27b", quant="q4_k")
    s = plan.shape
    assert (s.arch, s.n_layer, s.n_embd, s.n_ff, s.n_head, s.n_head_kv, s.head_dim) == \
        ("qwen35", 64, 5120, 17408, 24, 4, 256)
    assert s.attention_layers == list(range(3, 64, 4)) and len(s.attention_layers) == 16
    t = {spec.name: spec for spec in plan.tensors}
    assert len(t) == 851
    assert t["token_embd.weight"].ne == (5120, 248320) and t["output.weight"].ne == (5120, 248320)
    assert t["blk.3.attn_q.weight"].ne == (5120, 24 * 256 * 2)  # query + output gate
    assert t["blk.3.attn_k.weight"].ne == (5120, 4 * 256)
    assert t["blk.0.attn_qkv.weight"].ne == (5120, 2 * 16 * 128 + 48 * 128)
    assert t["blk.0.ssm_conv1d.weight"].ne == (4, 2 * 16 * 128 + 48 * 128)
    assert t["blk.0.ssm_a"].ne == (48,)
    assert "blk.0.attn_q.weight" not in t and "blk.3.ssm_a" not in t
    assert all(spec.qtype == synth.Q4_K for spec in plan.tensors if spec.init == "quant")
    # 16 attention layers x 4 KV heads x 256 x (K+V) x 2 bytes (f16) = 64 KiB of KV per token
    assert len(s.attention_layers) * s.n_head_kv * s.head_dim * 2 * 2 == 64 * 1024
    assert 14.5e9 < plan.data_bytes < 15.5e9

    mtp = synth.plan_for("qwen35", "qwen35-27b", mtp=True, quant="q4_0")
    names = {spec.name for spec in mtp.tensors}
    assert {"blk.64.nextn.eh_proj.weight", "blk.64.attn_q.weight", "blk.64.ffn_down.weight"} <= names
    assert 0.1e9 < mtp.data_bytes - plan.data_bytes < 0.5e9


def test_bad_arch_preset_and_combinations_are_clear_errors() -> None:
    with pytest.raises(KvmemError, match="unknown arch 'gpt5'"):
        synth.preset_shape("gpt5", "tiny")
    with pytest.raises(KvmemError, match="unknown preset 'huge'"):
        synth.preset_shape("qwen35", "huge")
    with pytest.raises(KvmemError, match="has no llama shape"):
        synth.preset_shape("llama", "qwen35-27b")
    with pytest.raises(KvmemError, match="--mtp needs arch qwen35"):
        synth.preset_shape("qwen3", "tiny", mtp=True)
    with pytest.raises(KvmemError, match="several archs"):
        synth.preset_shape(None, "tiny")


# --- files (metadata read back) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY_IDS)
def test_tiny_metadata_matches_the_plan(tiny_models: dict[str, Path], name: str) -> None:
    arch, mtp = TINY[TINY_IDS.index(name)]
    path = tiny_models[name]
    shape = synth.preset_shape(arch, "tiny", mtp=mtp)
    plan = synth.make_plan(shape, "q4_k")
    reader = GGUFReader(path)
    assert _meta(reader, "general.architecture") == arch
    assert _meta(reader, f"{arch}.block_count") == shape.n_layer + (1 if mtp else 0)
    assert _meta(reader, f"{arch}.embedding_length") == shape.n_embd
    assert _meta(reader, f"{arch}.attention.head_count_kv") == shape.n_head_kv
    assert _meta(reader, f"{arch}.attention.key_length") == shape.head_dim
    assert len(_meta(reader, "tokenizer.ggml.tokens")) == plan.n_vocab
    if arch == "qwen35":
        assert _meta(reader, "qwen35.full_attention_interval") == 4
        assert _meta(reader, "qwen35.rope.dimension_sections") == [3, 3, 2, 0]
        assert ("qwen35.nextn_predict_layers" in reader.fields) == mtp
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {spec.name for spec in plan.tensors}
    for spec in plan.tensors:
        assert tuple(int(n) for n in tensors[spec.name].shape) == spec.ne, spec.name
        assert int(tensors[spec.name].tensor_type) == spec.qtype, spec.name
    ssm_a = [np.asarray(t.data) for n, t in tensors.items() if n.endswith(".ssm_a")]
    assert len(ssm_a) == (6 if arch == "qwen35" else 0)
    assert all((a < 0).all() for a in ssm_a)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    """Byte-identical for a seed, whatever the number of generator threads."""
    a = synth.synthesize(tmp_path / "a.gguf", "qwen3", "tiny", seed=5, threads=1).path
    b = synth.synthesize(tmp_path / "b.gguf", "qwen3", "tiny", seed=5, threads=3).path
    c = synth.synthesize(tmp_path / "c.gguf", "qwen3", "tiny", seed=6).path
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b, c)]
    assert digest[0] == digest[1] != digest[2]


def test_interrupt_leaves_no_file_behind(tmp_path: Path) -> None:
    """Ctrl-C in the middle: neither the output nor its .part remain (and another donor works)."""
    seen: list[str] = []

    def interrupt(done: int, total: int, name: str) -> None:
        seen.append(name)
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synth.synthesize(tmp_path / "m.gguf", "qwen3", "tiny", donor="smollm2", threads=2, progress=interrupt)
    assert seen and not list(tmp_path.iterdir())
    done = synth.synthesize(tmp_path / "m.gguf", "qwen3", "tiny", donor="smollm2")
    assert done.plan.n_vocab == 49152 and done.path.stat().st_size == done.file_bytes


# --- CLI ----------------------------------------------------------------------------------------------------------

def test_cli_writes_refuses_overwrite_and_dry_runs(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "m.gguf"
    args = ["--arch", "qwen35", "--preset", "tiny", "--mtp", "--quant", "q4_0", "--seed", "3", "-o", str(out)]
    ok = runner.invoke(synth_cmd, args)
    assert ok.exit_code == 0, ok.output
    assert "wrote" in ok.output and out.stat().st_size > 1_000_000
    assert not (tmp_path / "m.gguf.part").exists()

    again = runner.invoke(synth_cmd, args)
    assert isinstance(again.exception, KvmemError) and "already exists" in str(again.exception)
    assert runner.invoke(synth_cmd, [*args, "--force"]).exit_code == 0

    bad = runner.invoke(synth_cmd, ["--arch", "gpt5", "-o", str(tmp_path / "x.gguf")])
    assert bad.exit_code == 2 and "gpt5" in bad.output

    vision = tmp_path / "mmproj.gguf"  # the projector of the same model, sized for its hidden width
    both = runner.invoke(synth_cmd, [*args, "--force", "--mmproj", str(vision)])
    assert both.exit_code == 0, both.output
    meta = {k: synth._field_value(f) for k, f in GGUFReader(vision).fields.items()}
    assert meta["general.type"] == "mmproj"
    assert meta["clip.vision.projection_dim"] == synth.preset_shape("qwen35", "tiny").n_embd
    taken = runner.invoke(synth_cmd, [*args[:-1], str(tmp_path / "n.gguf"), "--mmproj", str(vision)])
    assert isinstance(taken.exception, KvmemError) and f"{vision} already exists" in str(taken.exception)
    assert not (tmp_path / "n.gguf").exists()  # refused before anything was written
    llama = runner.invoke(synth_cmd, ["--arch", "llama", "-o", str(tmp_path / "l.gguf"), "--mmproj",
                                      str(tmp_path / "v.gguf"), "--donor", "smollm2"])
    assert isinstance(llama.exception, KvmemError) and "for qwen35 models" in str(llama.exception)

    dry = runner.invoke(synth_cmd, ["--preset", "qwen35-27b", "--mtp", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "16 full attention" in dry.output and "14.4 GiB" in dry.output
    assert not list(tmp_path.glob("*.part"))


# --- the engine ---------------------------------------------------------------------------------------------------

def _last_logits(llm, tokens: list[int]) -> np.ndarray:
    from kvmem_llama.binding import ffi

    llm.reset()
    llm.decode(tokens)
    ptr = llm._lib.llama_get_logits_ith(llm._ctx, -1)
    return np.frombuffer(ffi.buffer(ptr, llm.n_vocab * 4), dtype=np.float32).copy()


@pytest.mark.engine
@pytest.mark.parametrize("name", TINY_IDS)
def test_tiny_loads_and_generates(cpu_engine, tiny_models: dict[str, Path], name: str) -> None:
    from kvmem_llama.binding import Llama

    with Llama.load(tiny_models[name], n_ctx=2048, n_threads=1, libllama=cpu_engine.libllama) as llm:
        assert llm.describe().startswith(TINY[TINY_IDS.index(name)][0] + " ")
        long_prompt = " ".join(f"item{i}" for i in range(400)) + " The end"
        logits = _last_logits(llm, llm.tokenize(long_prompt))
        assert np.isfinite(logits).all() and logits.std() > 0.5  # no NaN/inf, not flat after every layer
        other = _last_logits(llm, llm.tokenize("Something else entirely. The end"))
        assert not np.allclose(logits, other)  # the context (attention / delta-net state) matters
        out = llm.generate("Once upon a time", max_tokens=16, temperature=0)
        assert len(out.tokens) == 16 and out.text.strip()


@pytest.mark.engine
def test_qwen35_mtp_serves_with_draft_mtp(llama_server, tiny_models: dict[str, Path]) -> None:
    """llama-server --spec-type draft-mtp runs the MTP head on CPU; drafts are partly accepted; greedy text
    equals the text without speculation."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog because", "n_predict": 48, "temperature": 0}
    with llama_server(tiny_models["qwen35-mtp"], ["-c", "2048", "--spec-type", "draft-mtp"]) as srv:
        spec = httpx.post(f"{srv.url}/completion", json=body, timeout=120).json()
        log = srv.log()
    assert "MTP draft context" in log
    timings = spec["timings"]
    assert spec["content"] and timings["predicted_n"] == 48
    assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] < timings["draft_n"]
    with llama_server(tiny_models["qwen35-mtp"], ["-c", "2048"]) as srv:
        plain = httpx.post(f"{srv.url}/completion", json=body, timeout=120).json()
    assert plain["content"] == spec["content"]


@pytest.mark.engine
@pytest.mark.slow
def test_qwen35_27b_truncated_loads_and_generates(cpu_engine, tmp_path: Path) -> None:
    """The real 27B layer shapes (4 layers: 3 delta-net + 1 attention, + MTP) load and run: ~2.7 GB."""
    from kvmem_llama.binding import Llama

    result = synth.synthesize(tmp_path / "27b-4l.gguf", None, "qwen35-27b", mtp=True, n_layer=4, quant="q4_k")
    assert result.file_bytes == pytest.approx(result.plan.data_bytes, rel=0.01)
    with Llama.load(result.path, n_ctx=512, libllama=cpu_engine.libllama) as llm:
        assert llm.n_vocab == 248320
        logits = _last_logits(llm, llm.tokenize("Hello world, this is a test of"))
        assert np.isfinite(logits).all() and logits.std() > 0.5
        assert len(llm.generate("Hi", max_tokens=2, temperature=0).tokens) == 2
