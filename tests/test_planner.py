"""The VRAM ledger against hand-computed numbers: real shipped GGUFs and a synthetic Qwen3.8-27B shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem_llama import hardware, planner
from kvmem_llama.errors import KvmemError
from kvmem_llama.models.gguf_header import GGUFHeader, TensorInfo
from kvmem_llama.models.gguf_info import ModelInfo, cache_type_bytes, model_info
from kvmem_llama.planner import GiB, MiB
from kvmem_llama.serving import argv
from kvmem_llama.shipped import shipped_model_path

# Qwen3.8-27B as llama.cpp's qwen35 arch sees it: 64 trunk layers (every 4th is full attention),
# one MTP (nextn) layer, 4 KV heads of 256 dims.
QWEN27B_META = {
    "general.architecture": "qwen35", "general.name": "Qwen3.8-27B",
    "qwen35.block_count": 65, "qwen35.nextn_predict_layers": 1, "qwen35.full_attention_interval": 4,
    "qwen35.attention.head_count": 24, "qwen35.attention.head_count_kv": 4,
    "qwen35.attention.key_length": 256, "qwen35.attention.value_length": 256,
    "qwen35.embedding_length": 5120, "qwen35.context_length": 262144, "qwen35.vocab_size": 248320,
}
QWEN27B_WEIGHTS = 12 * GiB  # an IQ3-class file, MTP head included
QWEN27B_MTP = GiB // 2


def hw(vram: str | None, ram: str = "64G") -> hardware.Hardware:
    return hardware.detect(vram=vram if vram is not None else "0", ram=ram)


@pytest.fixture(scope="module")
def qwen27b() -> ModelInfo:
    """The header of such a file: its metadata, the trunk's weights and the MTP block's (blk.64) as two tensors."""
    trunk = TensorInfo("blk.0.ffn_up.weight", (QWEN27B_WEIGHTS - QWEN27B_MTP,), "I8", 0, QWEN27B_WEIGHTS - QWEN27B_MTP)
    mtp = TensorInfo("blk.64.nextn.eh_proj.weight", (QWEN27B_MTP,), "I8", trunk.nbytes, QWEN27B_MTP)
    return model_info(GGUFHeader(Path("qwen27b.gguf"), 3, QWEN27B_WEIGHTS, QWEN27B_META, [trunk, mtp], 0))


def test_without_nvidia_ml_py_there_is_no_gpu_and_the_reason_says_so(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails, as without the gpu extra
    found = hardware.detect()
    assert not found.has_gpu and found.driver is None and found.ram_total > 0
    assert "nvidia-ml-py is not installed" in (found.nvml_error or "") and "kvmem-llama[gpu]" in found.nvml_error
    assert hardware.process_vram([1]) == {}


def test_parse_size() -> None:
    assert hardware.parse_size("16G") == 16 * GiB
    assert hardware.parse_size("16GiB") == 16 * GiB
    assert hardware.parse_size("512M") == 512 * MiB
    assert hardware.parse_size("1.5g") == 3 * GiB // 2
    with pytest.raises(KvmemError):
        hardware.parse_size("lots")


def test_cache_type_bytes() -> None:
    assert cache_type_bytes("f16", 64) == 128
    assert cache_type_bytes("q8_0", 64) == 68  # 34 bytes per 32
    assert cache_type_bytes("q5_0", 64) == 44  # 22 per 32
    assert cache_type_bytes("q4_0", 64) == 36  # 18 per 32
    with pytest.raises(KvmemError):
        cache_type_bytes("q8_0", 48)  # not a whole block
    with pytest.raises(KvmemError):
        cache_type_bytes("q3_x", 64)


def test_smollm2_shape_and_cpu_plan() -> None:
    shape = model_info(shipped_model_path("smollm2"))
    assert (shape.arch, shape.n_layers, shape.n_attention_layers) == ("llama", 30, 30)
    assert (max(shape.kv_heads), shape.head_dim_k, shape.n_vocab, shape.native_ctx) == (3, 64, 49152, 8192)
    # 30 layers x 3 KV heads x 64 dims x (K+V) x 2 B
    assert shape.kv_bytes("f16") == 30 * 3 * 64 * 2 * 2 == 23040
    # q8_0: 192 values per layer and tensor -> 6 blocks x 34 B = 204 B; x2 (K,V) x 30 layers
    assert shape.kv_bytes("q8_0") == 12240
    assert shape.kv_bytes("q5_0") == 30 * 2 * 6 * 22 == 7920
    assert shape.weights_bytes == 96_576_768  # sum of the tensor sizes in the file (header excluded)
    plan = planner.plan(shape, hw(None))
    prof = plan.profile
    assert (prof.device, prof.ctx, prof.budget, prof.ctk, prof.host_mib) == ("cpu", 8192, 0, "f16", 0)
    ledger = {item: size for item, size, _ in plan.ledger}
    assert ledger["KV cache"] == 8192 * 23040 == 188_743_680
    assert ledger["compute buffers"] == 4 * 512 * (49152 + 4 * 576) == 105_381_888
    assert plan.warnings == [] and plan.fits


def test_qwen25_coder_shape_and_plans() -> None:
    shape = model_info(shipped_model_path("qwen2.5-coder:0.5b"))
    assert (shape.arch, shape.n_layers, max(shape.kv_heads), shape.head_dim_k) == ("qwen2", 24, 2, 64)
    assert shape.kv_bytes("f16") == 24 * 2 * 64 * 2 * 2 == 12288
    assert shape.kv_bytes("q8_0") == 24 * 2 * 4 * 34 * 2 // 2 == 6528
    # GPU with room to spare: the full 32K context stays on the GPU, tiering off
    gpu = planner.plan(shape, hw("8G"))
    assert (gpu.profile.device, gpu.profile.ctx, gpu.profile.budget, gpu.profile.ctk) == ("gpu", 32768, 0, "f16")
    assert dict((i, s) for i, s, _ in gpu.ledger)["KV working set"] == 32768 * 12288
    # 1 GiB of RAM: 0.9 GiB - weights - compute leaves room for 13216 tokens -> 12288 (whole K)
    cpu = planner.plan(shape, hw(None, "1G"))
    room = int(GiB * 0.9) - 485_452_288 - 4 * 512 * (151936 + 4 * 896)
    assert room // 12288 == 13216
    assert cpu.profile.ctx == 12288
    assert any("context lowered from 32768 to 12288" in w for w in cpu.warnings)


def test_qwen27b_kv_per_token(qwen27b: ModelInfo) -> None:
    assert qwen27b.n_layers == 64 and qwen27b.n_attention_layers == 16 and qwen27b.mtp_layers == 1
    assert qwen27b.kv_bytes("f16") == 16 * 4 * 256 * 2 * 2 == 64 * 1024
    assert qwen27b.kv_bytes("bf16") == 65536
    assert qwen27b.kv_bytes("q8_0") == 16 * 2 * 1024 * 34 // 32 == 34816
    assert qwen27b.kv_bytes("q5_0") == 16 * 2 * 1024 * 22 // 32 == 22528
    assert qwen27b.mtp_kv_bytes("f16") == 4 * 256 * 2 * 2
    assert (qwen27b.weights_bytes, qwen27b.mtp_weights_bytes) == (QWEN27B_WEIGHTS, QWEN27B_MTP)
    # the whole 256K history at bf16: 16 GiB
    assert qwen27b.kv_bytes("f16") * 262144 == 16 * GiB


# Hand arithmetic for the synthetic 27B at its 262144-token context (gen reserve 4096):
#   trunk weights 11.5 GiB = 12_348_030_976, compute 4*512*(248320+4*5120) = 550_502_400,
#   overhead 512 MiB, MTP head 0.5 GiB + its q5_0 KV reservation 1408 B x (262144//6 + 4096) = 67_282_688.
TRUNK, COMPUTE, OVERHEAD, MTP_W, MTP_KV = 12_348_030_976, 550_502_400, 536_870_912, 536_870_912, 67_282_688


# Scoring on the GPU at 256K: f16 summaries 4096 B x 262400 tokens (the pool's 2050 blocks) = 1_074_790_400; its
# graph's memory: one layer's summaries as f32 (2/16 of that), one step's attention matrix (96 MiB: all 192 rows of
# a re-selection over 32800 chunk keys x 24 heads would take 604 MB), those 192 query rows (24 heads x 256 x 16
# layers, f32); the 64 MiB staging buffer
SUMMARIES = 1_074_790_400 + 1_074_790_400 // 8 + 96 * 2**20 + 192 * 24 * 256 * 16 * 4 + 64 * 2**20
assert 192 * 32800 * 24 * 4 > 96 * 2**20


def _budget(vram: int, per_token: int = 65536, scored_on_gpu: bool = True) -> int:
    room = vram - TRUNK - COMPUTE - OVERHEAD - MTP_W - MTP_KV - (SUMMARIES if scored_on_gpu else 0)
    return (room // per_token - 4096) // 128 * 128


def test_qwen27b_12gb_does_not_fit(qwen27b: ModelInfo) -> None:
    plan = planner.plan(qwen27b, hw("12G"))
    assert 12 * GiB - TRUNK - COMPUTE - OVERHEAD < 0
    assert not plan.fits
    # usable = 12 GiB - compute - overhead - 4096 tokens of q5_0 KV; layers = 64 * usable / trunk = 60.67
    usable = 12 * GiB - COMPUTE - OVERHEAD - 4096 * 22528
    assert plan.profile.n_gpu_layers == int(64 * usable / TRUNK) == 60
    assert plan.profile.budget == 0 and plan.profile.draft_mtp is False
    assert plan.fixes[0].startswith("use a smaller quantization")
    assert any("do not fit in 12.0 GiB" in w for w in plan.warnings)


def test_qwen27b_16gb_tiers_with_mtp(qwen27b: ModelInfo) -> None:
    """Scoring on the GPU takes 1.4 GiB first; an f16 working set would then hold 21,632 tokens, under 1/6 of 256K,
    so the plan takes a q8_0 working set (and pool) rather than scoring on the CPU."""
    plan = planner.plan(qwen27b, hw("16G"))
    assert _budget(16 * GiB) == 21632 and 262144 > 6 * 21632
    assert _budget(16 * GiB, scored_on_gpu=False) == 43776  # what scoring on the CPU would leave
    prof = plan.profile
    assert (prof.ctk, prof.budget, prof.gen_reserve, prof.draft_mtp, prof.score_on) == \
        ("q8_0", _budget(16 * GiB, 34816), 4096, True, "device") == ("q8_0", 44288, 4096, True, "device")
    assert 262144 <= 6 * prof.budget
    assert prof.host_mib == 8704  # the whole 256K history at q8_0
    assert dict((i, s) for i, s, _ in plan.ledger)["block summaries"] == SUMMARIES
    assert plan.warnings == [] and plan.fits


def test_qwen27b_24gb_bigger_budget(qwen27b: ModelInfo) -> None:
    plan = planner.plan(qwen27b, hw("24G"))
    assert plan.profile.budget == _budget(24 * GiB) == 152704 and plan.profile.score_on == "device"
    assert plan.profile.ctk == "f16" and plan.profile.draft_mtp


def test_qwen27b_32gb_everything_fits(qwen27b: ModelInfo) -> None:
    plan = planner.plan(qwen27b, hw("32G"))
    # 32 GiB - weights - compute - overhead - MTP = 20_320_180_480 >= 16 GiB of full KV: tiering off
    assert 32 * GiB - TRUNK - COMPUTE - OVERHEAD - MTP_W - MTP_KV == 20_320_180_480 >= 16 * GiB
    assert (plan.profile.budget, plan.profile.host_mib, plan.profile.ctx) == (0, 0, 262144)
    assert dict((i, s) for i, s, _ in plan.ledger)["KV working set"] == 16 * GiB


def test_qwen27b_warnings(qwen27b: ModelInfo) -> None:
    # 1M tokens on 16 GB: even q5_0 leaves ctx > 6x budget; MTP is dropped to save room
    plan = planner.plan(qwen27b, hw("16G"), ctx=1 << 20)
    assert plan.profile.ctk == "q5_0" and plan.profile.draft_mtp is False
    assert any("more than 6x the GPU budget" in w for w in plan.warnings)
    # host RAM short of the 16 GiB pool
    short = planner.plan(qwen27b, hw("24G", "8G"))
    assert any("host RAM is short" in w and "16384 MiB" in w for w in short.warnings)
    # user cache types win
    forced = planner.plan(qwen27b, hw("16G"), ctk="q8_0")
    assert (forced.profile.ctk, forced.profile.ctv) == ("q8_0", "q8_0")


def test_not_a_gguf(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(KvmemError, match=r"not a GGUF file \(16 bytes; found a zip archive\)"):
        planner.plan_model(str(bad), hw(None))
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(shipped_model_path("smollm2").read_bytes()[:5000])
    with pytest.raises(KvmemError, match="truncated GGUF header") as err:
        planner.plan_model(str(truncated), hw(None))
    assert "download it again" in err.value.hint


def test_plan_cli_json() -> None:
    out = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", "plan", "qwen2.5-coder:0.5b",
                          "--vram", "16G", "--ram", "64G", "--ctx", "16384", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["profile"]["ctx"] == 16384 and data["profile"]["device"] == "gpu"
    assert data["kv_per_token"]["f16"] == 12288
    assert data["hardware"]["gpus"][0]["vram_total"] == 16 * GiB


def test_qwen27b_two_tiers_with_a_quantized_pool(qwen27b: ModelInfo) -> None:
    """-ctk/-ctv q5_0 sets the host pool's type: the whole 256K history in 5.5 GiB instead of 16. The working
    set stays f16 by default (the same budget as an f16 plan), or is q5_0 too with gpu_type same (a budget
    65536/22528 times larger); the ledger shows both tiers with their types."""
    f16 = planner.plan(qwen27b, hw("16G"))
    q5 = planner.plan(qwen27b, hw("16G"), ctk="q5_0")
    ledger = {item: (size, note) for item, size, note in q5.ledger}
    # an f16 working set beside the summaries would break the 6x rule: the summaries stay in host RAM, and the
    # plan says that selection then scores on the CPU and how to keep it on the GPU
    assert (q5.profile.ctk, q5.profile.gpu_type, q5.profile.budget, q5.profile.score_on) == \
        ("q5_0", "f16", _budget(16 * GiB, scored_on_gpu=False), "host")
    assert f16.profile.score_on == "device"
    assert any("selection scores on the CPU" in w and "--kvmem-gpu-type same" in w for w in q5.warnings)
    assert ledger["block summaries"][0] == 0
    assert "--kvmem-score-on" in argv.profile_args(q5.profile, "--kvmem-budget --kvmem-score-on", True, True)
    assert q5.profile.host_mib == 22528 * 262144 // 2**20 == 5632
    assert ledger["KV working set"] == (65536 * (43776 + 4096), "47872 tokens x 65536 B (f16/f16)")
    assert ledger["host KV pool"] == (5632 * 2**20, "262144 tokens x 22528 B (q5_0/q5_0)")
    same = planner.plan(qwen27b, hw("16G"), ctk="q5_0", gpu_type="same")
    # (scored on the GPU, about 3x the tokens of an f16 working set scored there)
    assert same.profile.gpu_type == "same" and same.profile.score_on == "device"
    assert same.profile.budget == _budget(16 * GiB, 22528) > 2.5 * _budget(16 * GiB)
    assert dict((i, n) for i, _, n in same.ledger)["KV working set"].endswith("x 22528 B (q5_0/q5_0)")
    help_text = "--kvmem-budget --kvmem-host-mib --kvmem-gpu-type"
    assert "--kvmem-gpu-type" not in argv.profile_args(q5.profile, help_text, True, True)
    flags = argv.profile_args(same.profile, help_text, True, True)
    assert flags[flags.index("--kvmem-gpu-type") + 1] == "same"


def test_automatic_kv_type_quantizes_the_working_set_for_budget(qwen27b: ModelInfo) -> None:
    """When only a bigger budget keeps 1M tokens near the 6x rule, the automatic choice quantizes the working
    set too (an f16 working set over a q5_0 pool would hold no more tokens than an f16 plan)."""
    plan = planner.plan(qwen27b, hw("16G"), ctx=1 << 20)
    assert (plan.profile.ctk, plan.profile.gpu_type) == ("q5_0", "same")
