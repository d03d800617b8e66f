"""Synthetic GGUF models: a given arch and shape, random weights, a real tokenizer from a donor GGUF.

Registries carry no qwen35 model, no MTP head and no 27B model small enough for CI, so the
engine's tests and benchmarks run on files written here. The weights are random but *valid*:
every quantized block has a sane f16 scale and symmetric values, linear layers are scaled by
1/sqrt(fan_in) (output projections also by 1/sqrt(2·n_layer)) so activations stay finite
through all layers, norms are ones, and the gated delta-net decay `ssm_a` is negative. Embedding
and LM head are untied (a tied random head mostly echoes the last token). The optional qwen35 MTP
block is built so its drafts agree with the trunk part of the time (see make_plan), which makes
`--spec-type draft-mtp` accept some drafts and reject others: both paths get exercised.

Tensors are generated chunk by chunk (64 MiB, a few threads, per-chunk seeds: the bytes depend on
the seed only) and streamed into `OUT.part`, renamed when complete; RAM stays ~0.6 GB for a 15 GB
file (mostly the donor's token list). The full qwen35-27b+MTP file (15.5 GB) took 82 s on a busy
2-core box (one generator thread, ~190 MB/s, disk-bound).

Layout and metadata follow the pinned llama.cpp loader (src/models/{llama,qwen3,qwen35}.cpp,
src/llama-model.cpp load_hparams, src/llama-arch.cpp names): keys and tensor names are written
as raw strings so any `gguf` version that can write a file works, whatever archs it knows.

One module of ~650 lines on purpose: the shapes, the tensor plan, the metadata and the writer
describe the same file tensor for tensor against one pinned loader, and each arch's part reads
top to bottom next to the others; split up, adding an arch would touch every piece.

The `qwen35-27b` preset is the Qwen3.8-27B shape (= the Qwen3.5/3.6-27B text config;
sources: the public Qwen3.5-27B / Qwen3.6-27B `config.json` text_config as quoted in several
public repositories and model cards, e.g. THUDM/slime scripts/models/qwen3.5-27B.sh):
hidden 5120, intermediate 17408, 64 layers with full attention every 4th layer (16 attention
layers), 24 query heads, 4 KV heads, head_dim 256, partial rotary 0.25 (64 rope dims, mrope
sections [11, 11, 10]), rope_theta 1e7, rms_norm_eps 1e-6, 262144 context; gated delta-net
with 16 key heads and 48 value heads of dim 128 (ssm.group_count 16, ssm.time_step_rank 48,
ssm.state_size 128, ssm.inner_size 6144), conv kernel 4; untied embeddings; one MTP layer.
The real vocabulary has 248320 entries; the donor is the Qwen2.5 tokenizer (151936 tokens), so
the token list is padded with unused `[PAD…]` tokens to 248320 to keep the real embedding size.
That is 26.9 B parameters in 851 tensors (27.3 B / 866 with the MTP block); in Q4_K or Q4_0 (both
4.5 bits per weight) the file is 15.2 GB = 14.1 GiB (15.4 GB = 14.4 GiB with the MTP block).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvmem_llama.errors import KvmemError

ARCHS = ("llama", "qwen3", "qwen35")
CHUNK_BYTES = 64 << 20  # generate and write this much per step: bounded RAM for any file size
ALIGNMENT = 32  # GGUF default data alignment

# ggml type ids and their (block elements, block bytes); from the GGUF format.
F32, F16, Q4_0, Q4_K = 0, 1, 2, 12
TYPE_SIZES: dict[int, tuple[int, int]] = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_K: (256, 144)}
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_K: "Q4_K"}
QUANTS = {"q4_0": Q4_0, "q4_k": Q4_K, "f16": F16}
# general.file_type (llama_ftype) for each --quant: MOSTLY_Q4_0, MOSTLY_Q4_K_S, MOSTLY_F16
FILE_TYPES = {"q4_0": 2, "q4_k": 14, "f16": 1}


@dataclass(frozen=True)
class Shape:
    """Everything that decides the tensors and metadata of a synthetic model."""

    arch: str
    n_layer: int  # trunk layers, without the MTP block
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    donor: str  # shipped-model name of the tokenizer donor
    n_ctx_train: int = 32768
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False  # untied: a tied random head mostly echoes the last input token
    vocab_size: int | None = None  # pad the donor vocab up to this many tokens
    # qwen35 only
    full_attention_interval: int = 4
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    ssm_conv_kernel: int = 4
    ssm_state_size: int = 0  # = head dim of the delta-net keys and values
    ssm_group_count: int = 0  # delta-net key heads
    ssm_time_step_rank: int = 0  # delta-net value heads
    mtp: bool = False
    # std of token_embd entries x sqrt(n_embd): the embedding's weight in the residual stream against the
    # layers' outputs (~1 each). Larger = the next token leans more on the current one (see the MTP block).
    embd_gain: float = 3.0

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + (1 if self.mtp else 0)

    @property
    def ssm_inner_size(self) -> int:
        return self.ssm_state_size * self.ssm_time_step_rank

    def is_recurrent(self, il: int) -> bool:
        """qwen35: delta-net layer unless (il+1) is a multiple of the interval (upstream's rule)."""
        return self.arch == "qwen35" and il < self.n_layer and (il + 1) % self.full_attention_interval != 0

    @property
    def attention_layers(self) -> list[int]:
        return [il for il in range(self.n_layer) if not self.is_recurrent(il)]


PRESETS: dict[str, dict[str, Shape]] = {
    "tiny": {
        # A few MB (the embedding of the donor vocab dominates); loads and generates in well under a second.
        "llama": Shape("llama", n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, head_dim=16, n_rot=16,
                       donor="smollm2", rope_base=10000.0, rms_eps=1e-5),
        "qwen3": Shape("qwen3", n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, n_rot=64,
                       donor="qwen2.5-coder:0.5b"),
        # the hybrid structure of the real model: 8 layers, full attention at layers 3 and 7
        "qwen35": Shape("qwen35", n_layer=8, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
                        donor="qwen2.5-coder:0.5b", rope_base=10_000_000.0, rope_sections=(3, 3, 2, 0),
                        ssm_state_size=32, ssm_group_count=2, ssm_time_step_rank=4, embd_gain=16.0),
    },
    "qwen35-27b": {
        "qwen35": Shape("qwen35", n_layer=64, n_embd=5120, n_ff=17408, n_head=24, n_head_kv=4, head_dim=256,
                        n_rot=64, donor="qwen2.5-coder:0.5b", n_ctx_train=262144, rope_base=10_000_000.0,
                        vocab_size=248320, rope_sections=(11, 11, 10, 0),
                        ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=48, embd_gain=16.0),
    },
}


def preset_shape(arch: str | None, preset: str, *, mtp: bool = False, n_layer: int | None = None) -> Shape:
    """The shape of PRESET for ARCH (ARCH may be None when the preset has a single arch)."""
    if preset not in PRESETS:
        raise KvmemError(f"unknown preset {preset!r}", hint=f"one of: {', '.join(PRESETS)}")
    by_arch = PRESETS[preset]
    if arch is None:
        if len(by_arch) != 1:
            raise KvmemError(f"preset {preset!r} exists for several archs", hint=f"pass --arch ({', '.join(by_arch)})")
        arch = next(iter(by_arch))
    if arch not in ARCHS:
        raise KvmemError(f"unknown arch {arch!r}", hint=f"one of: {', '.join(ARCHS)}")
    if arch not in by_arch:
        raise KvmemError(f"preset {preset!r} has no {arch} shape",
                         hint=f"for {preset!r} use --arch {'/'.join(by_arch)}")
    shape = by_arch[arch]
    if mtp:
        if arch != "qwen35":
            raise KvmemError(f"--mtp needs arch qwen35, not {arch}", hint="only qwen35 has an MTP (nextn) block here")
        shape = replace(shape, mtp=True)
    if n_layer is not None:
        if n_layer < 1:
            raise KvmemError(f"--layers must be at least 1, not {n_layer}")
        shape = replace(shape, n_layer=n_layer)
    return shape


# --- the tensor plan ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length (fan-in of a matmul weight)
    qtype: int
    init: str  # "quant" | "normal" | "ones" | "eye" | "ssm_a" | "ssm_dt" | "conv"
    std: float = 0.0

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def nbytes(self) -> int:
        block, size = TYPE_SIZES[self.qtype]
        return self.n_elements // block * size


@dataclass
class SynthPlan:
    shape: Shape
    quant: str
    tensors: list[TensorSpec]
    n_vocab: int

    @property
    def data_bytes(self) -> int:
        return sum(_pad(t.nbytes) for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    def bytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[TYPE_NAMES[t.qtype]] = out.get(TYPE_NAMES[t.qtype], 0) + t.nbytes
        return out


def _pad(n: int, align: int = ALIGNMENT) -> int:
    return (n + align - 1) // align * align


def _matrix_type(quant: int, ne0: int) -> int:
    """The requested quant where the row length allows it, else the next type that fits."""
    for qtype in (quant, Q4_0, F16):
        if ne0 % TYPE_SIZES[qtype][0] == 0:
            return qtype
    return F16


def make_plan(shape: Shape, quant: str = "q4_k", n_vocab: int | None = None) -> SynthPlan:
    """All tensors (names, ggml shapes, types, init) of SHAPE. n_vocab defaults to the padded/known vocab."""
    if quant not in QUANTS:
        raise KvmemError(f"unknown quant {quant!r}", hint=f"one of: {', '.join(QUANTS)}")
    qt = QUANTS[quant]
    if n_vocab is None:
        n_vocab = shape.vocab_size or _donor_vocab_size(shape.donor)
    s = shape
    E, F, L = s.n_embd, s.n_ff, s.n_layer
    out_std = 1.0 / math.sqrt(2 * L)  # residual-branch outputs: keeps the stream's growth ~sqrt(L)
    tensors: list[TensorSpec] = []

    def weight(name: str, ne0: int, ne1: int, std: float) -> None:
        qtype = _matrix_type(qt, ne0)
        tensors.append(TensorSpec(name, (ne0, ne1), qtype, "quant" if qtype in (Q4_0, Q4_K) else "normal", std))

    def mat(name: str, ne0: int, ne1: int, gain: float = 1.0) -> None:
        weight(name, ne0, ne1, gain / math.sqrt(ne0))

    def small(name: str, ne0: int, ne1: int, gain: float = 1.0) -> None:  # tiny projections: F16, as real files
        tensors.append(TensorSpec(name, (ne0, ne1), F16, "normal", gain / math.sqrt(ne0)))

    def vec(name: str, n: int, init: str = "ones") -> None:
        tensors.append(TensorSpec(name, (n,), F32, init))

    head_std = 3.0 / math.sqrt(E)  # LM head: logits of std ~3 over normalized hidden states
    emb_std = (head_std if s.tie_embeddings else s.embd_gain / math.sqrt(E))
    weight("token_embd.weight", E, n_vocab, emb_std)
    vec("output_norm.weight", E)
    if not s.tie_embeddings:
        weight("output.weight", E, n_vocab, head_std)

    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim

    def attention(p: str, gated: bool, out_gain: float = out_std) -> None:
        mat(f"{p}.attn_q.weight", E, q_dim * (2 if gated else 1))  # qwen35: query and output gate in one
        mat(f"{p}.attn_k.weight", E, kv_dim)
        mat(f"{p}.attn_v.weight", E, kv_dim)
        mat(f"{p}.attn_output.weight", q_dim, E, out_gain)

    def ffn(p: str, out_gain: float = out_std) -> None:
        mat(f"{p}.ffn_gate.weight", E, F)
        mat(f"{p}.ffn_up.weight", E, F)
        mat(f"{p}.ffn_down.weight", F, E, out_gain)

    for il in range(L):
        p = f"blk.{il}"
        vec(f"{p}.attn_norm.weight", E)
        if s.arch in ("llama", "qwen3"):
            attention(p, gated=False)
            if s.arch == "qwen3":
                vec(f"{p}.attn_q_norm.weight", s.head_dim)
                vec(f"{p}.attn_k_norm.weight", s.head_dim)
            vec(f"{p}.ffn_norm.weight", E)
        else:  # qwen35
            vec(f"{p}.post_attention_norm.weight", E)
            if s.is_recurrent(il):
                key_dim = s.ssm_state_size * s.ssm_group_count
                value_dim = s.ssm_inner_size
                mat(f"{p}.attn_qkv.weight", E, 2 * key_dim + value_dim)
                mat(f"{p}.attn_gate.weight", E, value_dim)
                tensors.append(TensorSpec(f"{p}.ssm_conv1d.weight", (s.ssm_conv_kernel, 2 * key_dim + value_dim), F32,
                                          "conv", 1.0 / math.sqrt(s.ssm_conv_kernel)))
                vec(f"{p}.ssm_dt.bias", s.ssm_time_step_rank, "ssm_dt")
                vec(f"{p}.ssm_a", s.ssm_time_step_rank, "ssm_a")
                small(f"{p}.ssm_beta.weight", E, s.ssm_time_step_rank)
                small(f"{p}.ssm_alpha.weight", E, s.ssm_time_step_rank)
                vec(f"{p}.ssm_norm.weight", s.ssm_state_size)
                mat(f"{p}.ssm_out.weight", value_dim, E, out_std)
            else:
                attention(p, gated=True)
                vec(f"{p}.attn_q_norm.weight", s.head_dim)
                vec(f"{p}.attn_k_norm.weight", s.head_dim)
        ffn(p)

    if s.mtp:
        # One nextn block after the trunk: a full-attention layer fed by eh_proj([enorm(emb), hnorm(h)]).
        # Random weights would make every draft wrong, so the block is built to guess like the trunk:
        # eh_proj passes the token embedding through, the attention and FFN branches are computed (their
        # KV cache is real) but their output projections are zero, so the draft is the LM head applied
        # to the normalized embedding of the last token: what the trunk predicts when the embedding
        # dominates its residual stream (embd_gain). Drafts are then partly accepted, partly rejected.
        p = f"blk.{L}"
        vec(f"{p}.attn_norm.weight", E)
        vec(f"{p}.post_attention_norm.weight", E)
        attention(p, gated=True, out_gain=0.0)
        vec(f"{p}.attn_q_norm.weight", s.head_dim)
        vec(f"{p}.attn_k_norm.weight", s.head_dim)
        ffn(p, out_gain=0.0)
        tensors.append(TensorSpec(f"{p}.nextn.eh_proj.weight", (2 * E, E), F16, "eye"))
        vec(f"{p}.nextn.enorm.weight", E)
        vec(f"{p}.nextn.hnorm.weight", E)
        vec(f"{p}.nextn.shared_head_norm.weight", E)
    return SynthPlan(shape, quant, tensors, n_vocab)


# --- metadata ------------------------------------------------------------------------------------------------------

def _arch_metadata(shape: Shape, n_vocab: int) -> list[tuple[str, str, object]]:
    """(key, kind, value) of the arch keys; kind is u32 | f32 | i32arr."""
    s, a = shape, shape.arch
    kv: list[tuple[str, str, object]] = [
        (f"{a}.context_length", "u32", s.n_ctx_train),
        (f"{a}.embedding_length", "u32", s.n_embd),
        (f"{a}.block_count", "u32", s.n_layer_all),
        (f"{a}.feed_forward_length", "u32", s.n_ff),
        (f"{a}.attention.head_count", "u32", s.n_head),
        (f"{a}.attention.head_count_kv", "u32", s.n_head_kv),
        (f"{a}.attention.key_length", "u32", s.head_dim),
        (f"{a}.attention.value_length", "u32", s.head_dim),
        (f"{a}.rope.dimension_count", "u32", s.n_rot),
        (f"{a}.rope.freq_base", "f32", s.rope_base),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", s.rms_eps),
        (f"{a}.vocab_size", "u32", n_vocab),
    ]
    if a == "qwen35":
        kv += [
            (f"{a}.full_attention_interval", "u32", s.full_attention_interval),
            (f"{a}.rope.dimension_sections", "i32arr", list(s.rope_sections)),
            (f"{a}.ssm.conv_kernel", "u32", s.ssm_conv_kernel),
            (f"{a}.ssm.state_size", "u32", s.ssm_state_size),
            (f"{a}.ssm.group_count", "u32", s.ssm_group_count),
            (f"{a}.ssm.time_step_rank", "u32", s.ssm_time_step_rank),
            (f"{a}.ssm.inner_size", "u32", s.ssm_inner_size),
        ]
        if s.mtp:
            kv.append((f"{a}.nextn_predict_layers", "u32", 1))
    return kv


@dataclass
class DonorTokenizer:
    path: Path
    fields: list[tuple[str, int, int | None, object]]  # (key, value type, array item type, value)
    n_vocab: int


def _field_value(field) -> object:
    """Decode a GGUFReader field (scalar, string or array) without relying on newer reader helpers."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        item = field.types[1] if len(field.types) > 1 else None
        if item == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if item is None:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    return bool(value) if vtype == GGUFValueType.BOOL else value.item()


@lru_cache(maxsize=4)
def _load_donor(path_str: str, mtime_ns: int) -> DonorTokenizer:
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(path_str)
    except Exception as exc:  # a truncated or foreign file: say which
        raise KvmemError(f"cannot read donor GGUF {path_str}: {exc}") from exc
    fields = []
    n_vocab = 0
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        item = fld.types[1] if fld.types[0] == GGUFValueType.ARRAY and len(fld.types) > 1 else None
        value = _field_value(fld)
        fields.append((key, int(fld.types[0]), None if item is None else int(item), value))
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)  # type: ignore[arg-type]
    if not n_vocab:
        raise KvmemError(f"{path_str} has no tokenizer.ggml.tokens", hint="pick a donor GGUF that carries a tokenizer")
    return DonorTokenizer(Path(path_str), fields, n_vocab)


def donor_path(name_or_path: str | Path) -> Path:
    """A shipped-model name ("qwen2.5-coder:0.5b", "smollm2") or a GGUF path."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".gguf" or candidate.exists():
        if not candidate.is_file():
            raise KvmemError(f"donor GGUF not found: {candidate}")
        return candidate
    from kvmem_llama.shipped import shipped_model_path

    return shipped_model_path(str(name_or_path))


def load_donor(name_or_path: str | Path) -> DonorTokenizer:
    path = donor_path(name_or_path).resolve()
    return _load_donor(str(path), path.stat().st_mtime_ns)


def _donor_vocab_size(name_or_path: str | Path) -> int:
    return load_donor(name_or_path).n_vocab


# --- random blocks -------------------------------------------------------------------------------------------------

Q4_0_STD = math.sqrt(21.5)  # std of (q - 8) for q uniform in 0..15
Q4_K_STD = math.sqrt(85.0)  # std of (2q - 15) for q uniform in 0..15
# Q4_K: all 8 sub-blocks with scale 2 and min 15 (6-bit packed), so w = d*(2q - 15): symmetric around 0
Q4_K_SCALES = np.array([2, 2, 2, 2, 15, 15, 15, 15, 0xF2, 0xF2, 0xF2, 0xF2], dtype=np.uint8)


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    words = rng.integers(0, np.iinfo(np.uint64).max, size=(n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


def _quant_blocks(rng: np.random.Generator, qtype: int, n_blocks: int, std: float) -> np.ndarray:
    """n_blocks random blocks whose dequantized values have mean 0 and standard deviation ~std."""
    _, size = TYPE_SIZES[qtype]
    blocks = _random_bytes(rng, n_blocks * size).reshape(n_blocks, size)
    # each block's f16 scale: one of 256 values, std x [0.75, 1.25] (real files' scales differ per block too)
    jitter = np.linspace(0.75, 1.25, 256)
    if qtype == Q4_0:
        scales = std / Q4_0_STD * jitter * np.where(np.arange(256) % 2, 1.0, -1.0)  # signs cancel the -0.5 offset
    elif qtype == Q4_K:
        scales = std / Q4_K_STD * jitter
    else:
        raise ValueError(f"not a quant type: {qtype}")
    table = scales.astype(np.float16).view(np.uint8).reshape(256, 2)
    d = table[_random_bytes(rng, n_blocks)]
    blocks[:, 0:2] = d
    if qtype == Q4_K:
        blocks[:, 2:4] = d  # dmin = d: min 15 * dmin = 7.5 * (scale 2 * d), the center
        blocks[:, 4:16] = Q4_K_SCALES
    return blocks.reshape(-1)


def _dense_values(rng: np.random.Generator, spec: TensorSpec) -> np.ndarray:
    n = spec.n_elements
    if spec.init == "ones":
        values = np.ones(n, dtype=np.float32)
    elif spec.init == "eye":  # [I | 0]: output j = input j (the first ne1 inputs)
        values = np.eye(spec.ne[1], spec.ne[0], dtype=np.float32).reshape(-1)
    elif spec.init == "conv":
        values = rng.uniform(-spec.std, spec.std, n).astype(np.float32)
    elif spec.init == "ssm_a":  # -exp(A_log) with A in [1, 16]: a decaying gate exp(softplus(.) * ssm_a) < 1
        values = -rng.uniform(1.0, 16.0, n).astype(np.float32)
    elif spec.init == "ssm_dt":  # dt bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))
        values = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    else:
        raise ValueError(f"unknown init {spec.init!r}")
    return values.astype(np.float16) if spec.qtype == F16 else values


def _chunk_jobs(spec: TensorSpec, seed: np.random.SeedSequence,
                chunk_bytes: int) -> list[Callable[[], np.ndarray]]:
    """Independent jobs, one per chunk of the tensor, each with its own seed: any thread may run any job and
    the bytes are the same (they depend on the seed and chunk_bytes only)."""
    if spec.init not in ("quant", "normal"):  # norms, biases, eye, conv: small, one chunk
        return [lambda: _dense_values(np.random.Generator(np.random.SFC64(seed)), spec).view(np.uint8)]
    block, size = TYPE_SIZES[spec.qtype]
    total = spec.n_elements // block
    step = max(1, chunk_bytes // size)
    counts = [min(step, total - start) for start in range(0, total, step)]

    def job(n: int, ss: np.random.SeedSequence) -> Callable[[], np.ndarray]:
        if spec.init == "normal":  # a dense (F16/F32) weight, possibly large (--quant f16)
            dtype = np.float16 if spec.qtype == F16 else np.float32
            return lambda: (np.random.Generator(np.random.SFC64(ss)).standard_normal(n, dtype=np.float32)
                            * np.float32(spec.std)).astype(dtype).view(np.uint8)
        return lambda: _quant_blocks(np.random.Generator(np.random.SFC64(ss)), spec.qtype, n, spec.std)

    return [job(n, ss) for n, ss in zip(counts, seed.spawn(len(counts)), strict=True)]


def tensor_chunks(spec: TensorSpec, seed: np.random.SeedSequence | int = 0,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """The tensor's data as uint8 chunks of at most ~chunk_bytes (quantized tensors are never whole in RAM)."""
    if not isinstance(seed, np.random.SeedSequence):
        seed = np.random.SeedSequence(seed)
    for job in _chunk_jobs(spec, seed, chunk_bytes):
        yield job()


def _ordered_results(jobs: Iterator[tuple[TensorSpec, Callable[[], np.ndarray]]],
                     threads: int) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """Run jobs on a thread pool (numpy's generators and copies release the GIL), yielding results in order;
    at most 2 x threads chunks are in flight, so RAM stays bounded."""
    if threads <= 1:
        for spec, job in jobs:
            yield spec, job()
        return
    with ThreadPoolExecutor(threads) as pool:
        window: deque = deque()
        try:
            for spec, job in jobs:
                window.append((spec, pool.submit(job)))
                if len(window) >= 2 * threads:
                    head_spec, fut = window.popleft()
                    yield head_spec, fut.result()
            while window:
                head_spec, fut = window.popleft()
                yield head_spec, fut.result()
        finally:
            for _, fut in window:
                fut.cancel()


# --- writing -------------------------------------------------------------------------------------------------------

ProgressFn = Callable[[int, int, str], None]  # (bytes done, bytes total, current tensor)


@dataclass
class SynthResult:
    path: Path
    plan: SynthPlan
    file_bytes: int
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def mb_per_s(self) -> float:
        return self.file_bytes / 1e6 / self.seconds if self.seconds else 0.0


def _add_metadata(writer, plan: SynthPlan, donor: DonorTokenizer, seed: int, preset: str) -> None:
    from gguf import GGUFValueType

    s = plan.shape
    writer.add_string("general.type", "model")
    writer.add_string("general.name", f"kvmem synthetic {s.arch} {preset}{' +mtp' if s.mtp else ''}")
    writer.add_uint32("general.file_type", FILE_TYPES[plan.quant])
    writer.add_uint32("general.quantization_version", 2)
    writer.add_string("kvmem.synth.preset", preset)
    writer.add_uint32("kvmem.synth.seed", seed)
    writer.add_string("kvmem.synth.donor", donor.path.name)
    for key, kind, value in _arch_metadata(s, plan.n_vocab):
        if kind == "u32":
            writer.add_uint32(key, int(value))  # type: ignore[arg-type]
        elif kind == "f32":
            writer.add_float32(key, float(value))  # type: ignore[arg-type]
        else:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    pad = plan.n_vocab - donor.n_vocab
    if pad < 0:
        raise KvmemError(f"donor vocab ({donor.n_vocab}) is larger than the model's ({plan.n_vocab})")
    for key, vtype, item, value in donor.fields:
        if pad and key == "tokenizer.ggml.tokens":
            value = [*value, *(f"[PAD{i}]" for i in range(donor.n_vocab, plan.n_vocab))]  # type: ignore[misc]
        elif pad and key == "tokenizer.ggml.token_type":
            value = [*value, *([5] * pad)]  # type: ignore[misc]  # 5 = UNUSED
        writer.add_key_value(key, value, GGUFValueType(vtype), sub_type=None if item is None else GGUFValueType(item))


def write_synthetic(plan: SynthPlan, out: str | Path, *, seed: int = 0, preset: str = "custom", force: bool = False,
                    progress: ProgressFn | None = None, threads: int | None = None,
                    zero_weights: bool = False) -> SynthResult:
    """Write PLAN to OUT (via OUT.part, renamed when complete: an interrupt leaves no broken GGUF behind).

    zero_weights: the tensor data is left as a hole of zeros (a sparse file): a well-formed GGUF of the
    real size and header that takes no disk and no time, for header and planning tests, not for running."""
    out = Path(out)
    if out.exists() and not force:
        raise KvmemError(f"{out} already exists", hint="pass --force to overwrite it")
    if out.parent and not out.parent.exists():
        raise KvmemError(f"directory {out.parent} does not exist")
    tok = load_donor(plan.shape.donor)
    if plan.n_vocab != max(tok.n_vocab, plan.shape.vocab_size or 0):
        plan = make_plan(plan.shape, plan.quant, n_vocab=max(tok.n_vocab, plan.shape.vocab_size or 0))
    total = plan.data_bytes
    t0 = time.monotonic()
    with writing_gguf(out, plan.shape.arch) as writer:
        _add_metadata(writer, plan, tok, seed, preset)
        fout = begin_tensor_data(writer, [(t.name, t.ne, t.nbytes, _gguf_type(t.qtype)) for t in plan.tensors])
        if zero_weights:
            fout.flush()
            fout.truncate(fout.tell() + total)
        else:
            _write_tensors(writer, fout, plan, seed, threads, progress)
    return SynthResult(out, plan, out.stat().st_size, time.monotonic() - t0)


def _write_tensors(writer, fout, plan: SynthPlan, seed: int, threads: int | None,
                   progress: ProgressFn | None) -> None:
    """The tensors' random data, generated in chunks on threads and written in plan order."""
    total, done = plan.data_bytes, 0
    tensor_seeds = np.random.SeedSequence(seed).spawn(len(plan.tensors))  # per tensor: order-free
    jobs = ((spec, job) for spec, ss in zip(plan.tensors, tensor_seeds, strict=True)
            for job in _chunk_jobs(spec, ss, CHUNK_BYTES))
    written: dict[str, int] = {}
    current: TensorSpec | None = None
    for spec, chunk in _ordered_results(jobs, threads or default_threads()):
        if spec is not current:
            if current is not None:
                done += _finish_tensor(writer, fout, current, written.get(current.name, 0))
            current = spec
        chunk.tofile(fout)
        written[spec.name] = written.get(spec.name, 0) + chunk.nbytes
        done += chunk.nbytes
        if progress:
            progress(done, total, spec.name)
    if current is not None:
        _finish_tensor(writer, fout, current, written.get(current.name, 0))


@contextlib.contextmanager
def writing_gguf(out: Path, arch: str) -> Iterator[Any]:
    """A GGUFWriter on OUT.part that becomes OUT when the block ends (an interrupt or error removes the part:
    no broken GGUF is left behind)."""
    from gguf import GGUFWriter

    part = out.with_name(out.name + ".part")
    writer = GGUFWriter(part, arch)
    try:
        yield writer
    except BaseException:
        writer.close()
        part.unlink(missing_ok=True)
        raise
    writer.close()
    os.replace(part, out)


def _finish_tensor(writer, fout, spec: TensorSpec, written: int) -> int:
    """Pad the tensor's data to the alignment; returns the padding written."""
    if written != spec.nbytes:  # a plan/generator mismatch would make a silently corrupt file
        raise RuntimeError(f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}")
    writer.write_padding(fout, written)
    return _pad(written) - written


def default_threads() -> int:
    """Generator threads: a few, not all cores (the disk is the limit beyond that)."""
    return max(1, min(8, (os.cpu_count() or 1) - 1))


def _gguf_type(qtype: int):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(qtype)


def plan_for(arch: str | None, preset: str = "tiny", *, mtp: bool = False, quant: str = "q4_k",
             donor: str | Path | None = None, n_layer: int | None = None) -> SynthPlan:
    """The plan of a preset (optionally with MTP, another donor or another layer count); writes nothing."""
    shape = preset_shape(arch, preset, mtp=mtp, n_layer=n_layer)
    if donor is not None:
        shape = replace(shape, donor=str(donor))
    return make_plan(shape, quant)


def begin_tensor_data(writer, tensors: list[tuple[str, tuple[int, ...], int, Any]]):
    """Declare the tensors (name, ggml shape, bytes, gguf type), write the header, the metadata and the tensor
    infos, and return the file at the aligned start of the tensor data (written in the same order)."""
    for name, ne, nbytes, qtype in tensors:
        writer.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    return fout


def synthesize(out: str | Path, arch: str | None, preset: str = "tiny", *, mtp: bool = False, quant: str = "q4_k",
               seed: int = 0, donor: str | Path | None = None, n_layer: int | None = None, force: bool = False,
               progress: ProgressFn | None = None, threads: int | None = None,
               zero_weights: bool = False) -> SynthResult:
    """Plan and write a synthetic model in one call (what `kvmem synth` does)."""
    plan = plan_for(arch, preset, mtp=mtp, quant=quant, donor=donor, n_layer=n_layer)
    return write_synthetic(plan, out, seed=seed, preset=preset, force=force, progress=progress, threads=threads,
                           zero_weights=zero_weights)
