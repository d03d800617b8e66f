"""What a GGUF header means for running the model: layers with a KV cache, KV bytes per token
per cache type, weights, the MTP head, sliding-window layers. One `ModelInfo` per file, read by
kvmem_llama.models.gguf_header; `kvmem inspect`, the planner and `kvmem doctor` all take it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvmem_llama.errors import KvmemError
from kvmem_llama.models.gguf_header import ArrayInfo, GGUFHeader, read_header

# Architectures whose every block is recurrent (no KV cache at all).
_RECURRENT_ARCHS = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
# Sliding-window archs: llama.cpp's default pattern (n, dense_first) when the GGUF has no
# `attention.sliding_window_pattern` (src/models/*.cpp load_swa_pattern calls).
_SWA_PATTERNS = {"gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False), "gemma3n": (5, False),
                 "cohere2": (4, False), "cohere2moe": (4, True), "exaone4": (4, False), "exaone-moe": (4, False),
                 "llama4": (4, False), "olmo2": (4, False), "openai-moe": (2, False), "gpt-oss": (2, False),
                 "afmoe": (4, False), "plamo3": (8, False), "smallthinker": (4, True)}
# Hybrids that mark attention layers with `full_attention_interval` (llama.cpp default 4).
_INTERVAL_ARCHS = {"qwen3next", "qwen35", "qwen35moe"}


# K/V cache types llama.cpp accepts for -ctk/-ctv; their (elements, bytes) per block come from gguf.
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")


def cache_type_bytes(cache_type: str, elements: int) -> int:
    """Bytes of a K or V row of `elements` values stored as `cache_type`."""
    if cache_type not in CACHE_TYPES:
        raise KvmemError(f"unknown KV cache type {cache_type!r}", hint=f"one of: {', '.join(CACHE_TYPES)}")
    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]
    if elements % per:
        raise KvmemError(f"{cache_type} needs rows that are a multiple of {per} values, this layer has {elements}",
                         hint="use f16 for this model's KV cache")
    return elements // per * size


@dataclass
class ModelInfo:
    """What kvmem knows of a model from its GGUF header: `kvmem inspect` shows it, the planner plans
    with it, `kvmem doctor` checks it, and the model store keeps a summary in its records.

    KV bytes count only layers that keep a KV cache: for a layer with `h` KV heads and head dims
    `dk`/`dv`, one token costs `h*dk` K and `h*dv` V values in the cache type (f16 2 bytes, q8_0
    34 per 32, q5_0 22 per 32, q4_0 18 per 32). Qwen3.8-27B: 16 * 4 * 256 * (K+V) * 2 B = 64 KiB.
    """

    path: str
    file_size: int
    gguf_version: int
    name: str | None
    arch: str
    n_layers: int  # main-model blocks (MTP/nextn blocks excluded)
    n_attention_layers: int
    n_recurrent_layers: int
    attention_layers: list[int]
    kv_heads: list[int]  # per main-model layer; 0 = the layer keeps no KV cache (recurrent)
    n_heads: int | None
    n_kv_heads: int | None
    head_dim_k: int | None
    head_dim_v: int | None
    embedding_length: int | None
    n_vocab: int | None
    native_ctx: int | None
    sliding_window: int | None
    rope: dict[str, Any]
    file_type: int | None
    n_tensors: int
    n_params: int
    weights_bytes: int  # every tensor whose type the gguf package knows (see unknown_tensor_types)
    unknown_tensor_types: list[str]
    quant_mix: dict[str, dict[str, int]]  # type -> {"tensors": n, "bytes": b}, largest first
    mtp_layers: int  # nextn / multi-token-prediction blocks in the file
    mtp_weights_bytes: int = 0  # part of weights_bytes that only the MTP draft needs
    mtp_kv_heads: int = 0
    swa_layers: list[int] = field(default_factory=list)  # attention layers limited to the sliding window
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)  # all attention layers, K+V, per cache type
    # growth per token past the sliding window (non-SWA attention layers only); == kv_bytes_per_token without SWA
    kv_bytes_per_token_full_attention: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def quant_summary(self, top: int = 3) -> str:
        total = sum(v["bytes"] for v in self.quant_mix.values()) or 1
        parts = [f"{k} {100 * v['bytes'] / total:.0f}%" for k, v in list(self.quant_mix.items())[:top]]
        return " ".join(parts)

    @property
    def trunk_weights_bytes(self) -> int:
        return self.weights_bytes - self.mtp_weights_bytes

    def kv_bytes(self, ctk: str = "f16", ctv: str | None = None) -> int:
        """K+V bytes per token over the layers with a KV cache, K stored as `ctk` and V as `ctv`."""
        return _kv_bytes(self.kv_heads, self.head_dim_k or 0, self.head_dim_v or 0, ctk, ctv or ctk)

    @property
    def summary_bytes_per_token(self) -> int:
        """The engine's block summaries per history token: f16 means of 8-token chunks of every attention layer's
        pre-RoPE keys (the `mass` scorer's), kept where the working set is (VRAM on a GPU) for scoring there."""
        return sum(h * (self.head_dim_k or 0) for h in self.kv_heads if h) * 2 // SUMMARY_CHUNK_TOKENS

    def mtp_kv_bytes(self, ctk: str = "f16", ctv: str | None = None) -> int:
        """The same for the MTP draft's layers (0 without an MTP head)."""
        heads = [self.mtp_kv_heads] * self.mtp_layers
        return _kv_bytes(heads, self.head_dim_k or 0, self.head_dim_v or 0, ctk, ctv or ctk)


SUMMARY_CHUNK_TOKENS = 8  # the engine's mass scorer summarizes 8-token chunks (llama-kvmem-score.cpp)


def _kv_bytes(kv_heads: list[int], head_dim_k: int, head_dim_v: int, ctk: str, ctv: str) -> int:
    return sum(cache_type_bytes(ctk, h * head_dim_k) + cache_type_bytes(ctv, h * head_dim_v) for h in kv_heads if h)


def _kv_table(kv_heads: list[int], head_dim_k: int | None, head_dim_v: int | None) -> dict[str, int]:
    """K+V bytes per token for every cache type these head sizes allow (quantized rows need whole blocks)."""
    table: dict[str, int] = {}
    if not head_dim_k or not head_dim_v:
        return table
    for cache_type in CACHE_TYPES:
        try:
            table[cache_type] = _kv_bytes(kv_heads, head_dim_k, head_dim_v, cache_type, cache_type)
        except KvmemError:
            continue
    return table


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    return None


def _per_layer(value: Any, n: int) -> list[int] | None:
    """A per-layer table (a list) or a scalar broadcast to n layers."""
    if isinstance(value, list):
        return [int(v) for v in value][:n] + [int(value[-1]) if value else 0] * max(0, n - len(value))
    v = _as_int(value)
    return None if v is None else [v] * n


def _keeps_kv(arch: str, key, n_layers: int, n_kv: list[int]) -> list[bool]:
    """Which main-model layers keep a KV cache: an explicit recurrent table, the interval rule of the
    hybrids, an all-recurrent arch, or else per-layer KV heads of 0."""
    recurrent = key("attention.recurrent_layers")
    if isinstance(recurrent, list) and recurrent:
        is_recurrent = [bool(x) for x in recurrent][:n_layers]
    elif arch in _INTERVAL_ARCHS:
        interval = _as_int(key("full_attention_interval")) or 4
        is_recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    elif arch in _RECURRENT_ARCHS:
        is_recurrent = [True] * n_layers
    else:
        is_recurrent = [kv == 0 for kv in n_kv[:n_layers]]
    is_recurrent += [False] * (n_layers - len(is_recurrent))
    return [not r for r in is_recurrent]


def _swa_layers(arch: str, key, attention: list[int]) -> list[int]:
    """Attention layers that see only the sliding window (llama_hparams::set_swa_pattern)."""
    window = _as_int(key("attention.sliding_window")) or 0
    if window <= 0:
        return []
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [i for i in attention if i < len(pattern) and bool(pattern[i])]
    if arch not in _SWA_PATTERNS and _as_int(pattern) is None:
        return []
    n, dense_first = _SWA_PATTERNS.get(arch, (0, False))
    if _as_int(pattern) is not None:
        n = _as_int(pattern)
    # n == 0 means every layer is SWA
    return [i for i in attention if n == 0 or (i % n != 0 if dense_first else i % n < n - 1)]


def model_info(source: str | Path | GGUFHeader) -> ModelInfo:
    h = source if isinstance(source, GGUFHeader) else read_header(source)
    arch = h.arch
    m = h.metadata

    def key(suffix: str, default: Any = None) -> Any:
        return m.get(f"{arch}.{suffix}", default)

    n_block = _as_int(key("block_count")) or 0
    mtp = _as_int(key("nextn_predict_layers")) or 0
    if not mtp:  # some converters only leave the tensors behind
        mtp = len({t.name.split(".")[1] for t in h.tensors if ".nextn." in t.name})
    n_layers = max(n_block - mtp, 0)
    n_heads_l = _per_layer(key("attention.head_count"), n_block) or []
    n_kv_all = _per_layer(key("attention.head_count_kv"), n_block) or list(n_heads_l)
    n_embd = _as_int(key("embedding_length"))
    n_heads = max(n_heads_l) if n_heads_l else None
    head_k = _as_int(key("attention.key_length")) or (n_embd // n_heads if n_embd and n_heads else None)
    head_v = _as_int(key("attention.value_length")) or head_k

    keeps_kv = _keeps_kv(arch, key, n_layers, n_kv_all)
    attn = [i for i in range(n_layers) if keeps_kv[i]]
    kv_heads = [n_kv_all[i] if keeps_kv[i] and i < len(n_kv_all) else 0 for i in range(n_layers)]
    kv_heads_attn = [kv_heads[i] for i in attn]
    n_kv = max(kv_heads_attn) if kv_heads_attn else (max(n_kv_all) if n_kv_all else None)

    rope = {k.split(".rope.", 1)[1]: v for k, v in m.items()
            if k.startswith(f"{arch}.rope.") and not isinstance(v, ArrayInfo)}

    mix: Counter[str] = Counter()
    count: Counter[str] = Counter()
    n_params = 0
    mtp_prefixes = tuple(f"blk.{i}." for i in range(n_layers, n_block))
    mtp_bytes = 0
    for t in h.tensors:
        count[t.type] += 1
        mix[t.type] += t.nbytes or 0
        n_params += math.prod(t.shape)
        if mtp_prefixes and t.name.startswith(mtp_prefixes):
            mtp_bytes += t.nbytes or 0
    quant_mix = {k: {"tensors": count[k], "bytes": mix[k]} for k, _ in mix.most_common()}
    unknown = sorted({t.type for t in h.tensors if t.nbytes is None})

    swa = _swa_layers(arch, key, attn)
    full_kv_heads = [0 if i in set(swa) else h_ for i, h_ in enumerate(kv_heads)]
    tokens = m.get("tokenizer.ggml.tokens")
    n_vocab = _as_int(key("vocab_size")) or (tokens.count if isinstance(tokens, ArrayInfo) else
                                            len(tokens) if isinstance(tokens, list) else None)
    return ModelInfo(
        path=str(h.path), file_size=h.file_size, gguf_version=h.version,
        name=m.get("general.name") if isinstance(m.get("general.name"), str) else None,
        arch=arch, n_layers=n_layers, n_attention_layers=len(attn), n_recurrent_layers=n_layers - len(attn),
        attention_layers=attn, kv_heads=kv_heads, n_heads=n_heads, n_kv_heads=n_kv, head_dim_k=head_k,
        head_dim_v=head_v, embedding_length=n_embd, n_vocab=n_vocab, native_ctx=_as_int(key("context_length")),
        sliding_window=_as_int(key("attention.sliding_window")), rope=rope,
        file_type=_as_int(m.get("general.file_type")), n_tensors=len(h.tensors), n_params=n_params,
        weights_bytes=sum(t.nbytes or 0 for t in h.tensors), unknown_tensor_types=unknown, quant_mix=quant_mix,
        mtp_layers=mtp, mtp_weights_bytes=mtp_bytes, mtp_kv_heads=n_kv_all[-1] if mtp and n_kv_all else 0,
        swa_layers=swa, kv_bytes_per_token=_kv_table(kv_heads, head_k, head_v),
        kv_bytes_per_token_full_attention=_kv_table(full_kv_heads, head_k, head_v),
    )
