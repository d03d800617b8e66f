"""GGUF inspection on the real PyPI-shipped files, a synthetic hybrid (qwen35-like) file, and broken files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import isolate_env, make_gguf

from kvmem_llama.models.gguf_header import GGUFFormatError, read_header
from kvmem_llama.models.gguf_info import model_info
from kvmem_llama.shipped import shipped_model_path


@pytest.fixture(scope="module")
def qwen05() -> Path:
    return shipped_model_path("qwen2.5-coder:0.5b")


def test_inspect_smollm2(smollm2):
    info = model_info(smollm2)
    assert (info.arch, info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim_k, info.native_ctx) == (
        "llama", 30, 9, 3, 64, 8192)
    assert info.n_attention_layers == 30 and info.n_recurrent_layers == 0 and info.mtp_layers == 0
    assert info.embedding_length == 576 and info.rope["freq_base"] == 100000.0
    # 30 layers x 3 KV heads x (64 + 64) dims: f16 2 bytes, q8_0 34/32, q5_0 22/32, q4_0 18/32
    expected = {"f16": 23040, "q8_0": 12240, "q5_0": 7920, "q4_0": 6480}
    assert {k: info.kv_bytes_per_token[k] for k in expected} == expected
    assert info.kv_bytes_per_token["f32"] == 2 * 23040 and info.kv_bytes("q8_0", "f16") == (12240 + 23040) // 2
    assert list(info.quant_mix) == ["Q4_1", "Q8_0", "F32"] and info.quant_mix["Q4_1"]["tensors"] == 210
    assert info.n_tensors == 272 and 134e6 < info.n_params < 135e6


def test_inspect_qwen25_coder_05b(qwen05):
    info = model_info(qwen05)
    assert (info.arch, info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim_k, info.native_ctx) == (
        "qwen2", 24, 14, 2, 64, 32768)
    assert info.kv_bytes_per_token["f16"] == 24 * 2 * 128 * 2 == 12288
    assert info.kv_bytes_per_token["q8_0"] == 24 * 2 * 128 * 34 / 32
    assert info.file_type == 15  # MOSTLY_Q4_K_M
    assert sum(v["tensors"] for v in info.quant_mix.values()) == info.n_tensors == 291


def test_header_reader_agrees_with_gguf_package(smollm2):
    from gguf import GGUFReader

    ours = read_header(smollm2)
    ref = GGUFReader(smollm2)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    assert [t.type for t in ours.tensors] == [t.tensor_type.name for t in ref.tensors]
    assert [t.nbytes for t in ours.tensors] == [int(t.n_bytes) for t in ref.tensors]
    assert ours.data_offset + ours.tensors[0].offset == int(ref.tensors[0].data_offset)
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key not in ours.metadata:
            continue
        value, theirs = ours.metadata[key], field.contents()
        if isinstance(value, float):
            assert theirs == pytest.approx(value), key
        elif isinstance(value, (str, int, list)):
            assert theirs == value, key


def test_inspect_gemma3_270m_sliding_window():
    info = model_info(shipped_model_path("gemma3:270m"))
    assert (info.arch, info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim_k, info.native_ctx) == (
        "gemma3", 18, 4, 1, 256, 32768)
    # llama.cpp's gemma3 pattern: every 6th layer is global, the rest see a 512-token window
    assert info.sliding_window == 512 and [i for i in range(18) if i not in info.swa_layers] == [5, 11, 17]
    assert info.kv_bytes_per_token["f16"] == 18 * 1 * 512 * 2
    assert info.kv_bytes_per_token_full_attention["f16"] == 3 * 1 * 512 * 2


def test_hybrid_with_mtp_counts_only_attention_layers(tmp_path):
    # Shaped like Qwen3.8-27B: 64 layers + 1 MTP block, full attention every 4th layer, 4 KV heads of 256.
    path = make_gguf(tmp_path / "hybrid.gguf", 1 << 16, arch="qwen35", kv={
        "block_count": 65, "nextn_predict_layers": 1, "full_attention_interval": 4, "context_length": 262144,
        "embedding_length": 5120, "attention.head_count": 24, "attention.head_count_kv": 4,
        "attention.key_length": 256, "attention.value_length": 256})
    info = model_info(path)
    assert info.n_layers == 64 and info.mtp_layers == 1
    assert info.n_attention_layers == 16 and info.n_recurrent_layers == 48
    assert info.attention_layers == list(range(3, 64, 4))
    assert info.kv_bytes_per_token["f16"] == 64 * 1024  # the design's 64 KiB/token
    assert info.kv_bytes_per_token["q5_0"] == 16 * 4 * 512 * 22 / 32


def test_per_layer_kv_heads_mark_recurrent_layers(tmp_path):
    path = make_gguf(tmp_path / "lfm.gguf", 1 << 16, arch="lfm2", kv={
        "block_count": 4, "attention.head_count": 8, "attention.head_count_kv": [0, 2, 0, 2],
        "embedding_length": 512})
    info = model_info(path)
    assert info.attention_layers == [1, 3] and info.n_kv_heads == 2
    assert info.kv_bytes_per_token["f16"] == 2 * 2 * 128 * 2


@pytest.mark.parametrize("content,expect", [
    (b"<!DOCTYPE html><html>404 Not Found</html>" * 3, "HTML page"),
    (b'{"error": "Repository not found"}' + b" " * 40, "JSON"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n", "Git LFS pointer"),
    (b"", "0 bytes"),
])
def test_not_gguf_says_what_was_found(tmp_path, content, expect):
    p = tmp_path / "model.gguf"
    p.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=expect):
        read_header(p)


def test_truncated_and_unreadable_versions(tmp_path, smollm2):
    full = make_gguf(tmp_path / "full.gguf", 1 << 20)
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-4096])
    with pytest.raises(GGUFFormatError, match=rf"tensor data needs {len(data)} bytes, the file has {len(data) - 4096}"):
        read_header(cut)
    with open(smollm2, "rb") as fh:
        head = fh.read(100_000)  # inside the tokenizer arrays
    (tmp_path / "head.gguf").write_bytes(head)
    with pytest.raises(GGUFFormatError, match="truncated GGUF header"):
        read_header(tmp_path / "head.gguf")
    for version, expect in ((1, "version 1 is no longer readable"), (4, "GGUF version 4, but this engine reads"),
                            (struct.unpack("<I", struct.pack(">I", 3))[0], "big-endian")):
        p = tmp_path / f"v{version}.gguf"
        p.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
        with pytest.raises(GGUFFormatError, match=expect):
            read_header(p)


def test_cli_inspect_json_and_table(monkeypatch, tmp_path, qwen05):
    isolate_env(monkeypatch, tmp_path)
    run = [sys.executable, "-m", "kvmem_llama.cli.main", "inspect"]
    out = subprocess.run([*run, "qwen2.5-coder:0.5b", "--json"], capture_output=True, text=True, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["arch"] == "qwen2" and data["n_kv_heads"] == 2 and data["path"] == str(qwen05)
    out = subprocess.run([*run, "gemma3:270m"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
    assert out.returncode == 0, out.stderr
    assert "gemma3" in out.stdout and "512 tokens on 15 layers" in out.stdout
    out = subprocess.run([*run, "qwen2.5-coder:05b"], capture_output=True, text=True, env=os.environ.copy())
    assert out.returncode == 1 and "did you mean: qwen2.5-coder:0.5b" in out.stderr.replace("\n", " ")
