"""The VRAM ledger: from GGUF metadata + hardware to a launch profile.

KV bytes per token count only layers that have a KV cache (a hybrid `qwen35` model has 16
full-attention layers out of 64; the rest are recurrent and keep a fixed-size state). For a
layer with `h` KV heads and head dims `dk`/`dv`, one token costs `h*dk` K elements and `h*dv`
V elements, each stored in the cache type: f16/bf16 2 bytes, q8_0 34 bytes per 32, q5_0 22 per
32, q4_0 18 per 32. Qwen3.8-27B: 16 * 4 * 256 * (K+V) * 2 B = 64 KiB per token at f16.

The estimates of compute buffers and overhead are deliberately simple formulas (documented at
their constants) so the plan can be checked by hand; they err on the generous side.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmem_llama.errors import KvmemError
from kvmem_llama.hardware import Hardware

MiB = 1 << 20
GiB = 1 << 30

# bytes per block of elements: (bytes, elements)
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (4, 1), "f16": (2, 1), "bf16": (2, 1),
    "q8_0": (34, 32), "q5_1": (24, 32), "q5_0": (22, 32), "q4_1": (20, 32), "q4_0": (18, 32), "iq4_nl": (18, 32),
}
# Automatic KV type choice, fastest first: quantized KV makes long-context decode slower
# (measured: 27B at 32K, f16 97 tok/s vs q5_0 68), so it is used only when f16 would shrink
# the working set past the 6x rule.
AUTO_CACHE_TYPES = ("f16", "q8_0", "q5_0")
CTX_PER_BUDGET = 6  # the anchor's rule of thumb: quality falls when context > 6x the GPU budget
BLOCK_TOKENS = 128
UBATCH = 512
GPU_OVERHEAD = 512 * MiB  # CUDA context, cuBLAS workspace, allocator slack
DEFAULT_GEN_RESERVE = 4096
MIN_GPU_KV_TOKENS = 4096  # below this a GPU plan is not worth it
RAM_HEADROOM = 0.9  # plan to use at most 90% of available RAM
# Architectures whose non-attention layers are recurrent and whose attention layers repeat
# every `full_attention_interval` (default 4), when the file has no explicit recurrent_layers.
INTERVAL_HYBRIDS = {"qwen35", "qwen35moe", "qwen3next"}
PURE_RECURRENT = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}


def cache_type_bytes(cache_type: str, elements: int) -> int:
    """Bytes of `elements` values stored as `cache_type`."""
    try:
        size, per = CACHE_TYPES[cache_type]
    except KeyError:
        raise KvmemError(f"unknown KV cache type {cache_type!r}", hint=f"one of: {', '.join(CACHE_TYPES)}") from None
    if elements % per:
        raise KvmemError(f"{cache_type} needs rows that are a multiple of {per} values, this layer has {elements}",
                         hint="use f16 for this model's KV cache")
    return elements // per * size


@dataclass
class ModelShape:
    """What the planner needs to know about a model, read from GGUF metadata."""

    name: str
    arch: str
    n_layer: int  # trunk layers, without MTP/nextn layers
    kv_heads: list[int]  # per trunk layer; 0 = the layer has no KV cache (recurrent)
    head_dim_k: int
    head_dim_v: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    weights_bytes: int  # every tensor in the file
    mtp_layers: int = 0
    mtp_weights_bytes: int = 0  # part of weights_bytes that only the MTP draft needs
    mtp_kv_heads: int = 0
    path: str | None = None

    @property
    def attention_layers(self) -> int:
        return sum(1 for h in self.kv_heads if h > 0)

    @property
    def trunk_weights_bytes(self) -> int:
        return self.weights_bytes - self.mtp_weights_bytes

    def kv_bytes_per_token(self, ctk: str = "f16", ctv: str | None = None) -> int:
        ctv = ctv or ctk
        return sum(cache_type_bytes(ctk, h * self.head_dim_k) + cache_type_bytes(ctv, h * self.head_dim_v)
                   for h in self.kv_heads if h > 0)

    def mtp_kv_bytes_per_token(self, ctk: str = "f16", ctv: str | None = None) -> int:
        if not self.mtp_layers:
            return 0
        ctv = ctv or ctk
        h = self.mtp_kv_heads
        per_layer = cache_type_bytes(ctk, h * self.head_dim_k) + cache_type_bytes(ctv, h * self.head_dim_v)
        return self.mtp_layers * per_layer

    def compute_buffer_bytes(self, ubatch: int = UBATCH) -> int:
        """Estimate: f32 logits for one ubatch plus ~4 activations of width n_embd per token."""
        return 4 * ubatch * (self.n_vocab + 4 * self.n_embd)


def _per_layer(value: Any, n: int) -> list[int]:
    if isinstance(value, (list, tuple)):
        vals = [int(v) for v in value]
        return (vals + [vals[-1]] * n)[:n] if vals else [0] * n
    return [int(value)] * n


def shape_from_metadata(meta: dict[str, Any], weights_bytes: int, mtp_weights_bytes: int = 0,
                        name: str | None = None, path: str | None = None) -> ModelShape:
    """Build a shape from GGUF key/values (`general.architecture`, `{arch}.block_count`, ...)."""
    try:
        arch = str(meta["general.architecture"])
    except KeyError:
        raise KvmemError("the GGUF has no general.architecture", hint="is this a model file?") from None

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    block_count = int(key("block_count", 0))
    if block_count <= 0:
        raise KvmemError(f"the GGUF has no {arch}.block_count")
    mtp = int(key("nextn_predict_layers", 0))
    n_layer = block_count - mtp
    n_embd = int(key("embedding_length", 0))
    n_head = max(_per_layer(key("attention.head_count", 0), block_count) or [0])
    kv_all = _per_layer(key("attention.head_count_kv", n_head), block_count)
    head_dim_k = int(key("attention.key_length", (n_embd // n_head) if n_head else 0))
    head_dim_v = int(key("attention.value_length", head_dim_k))
    kv_heads = kv_all[:n_layer]
    recurrent = key("attention.recurrent_layers")
    if isinstance(recurrent, (list, tuple)):
        kv_heads = [0 if bool(r) else h for h, r in zip(kv_heads, list(recurrent) + [False] * n_layer, strict=False)]
    elif arch in INTERVAL_HYBRIDS:
        interval = int(key("full_attention_interval", 4))
        kv_heads = [h if (i + 1) % interval == 0 else 0 for i, h in enumerate(kv_heads)]
    elif arch in PURE_RECURRENT:
        kv_heads = [0] * n_layer
    n_vocab = int(key("vocab_size", 0) or meta.get("tokenizer.ggml.tokens.count", 0) or 0)
    return ModelShape(
        name=name or str(meta.get("general.name", arch)), arch=arch, n_layer=n_layer, kv_heads=kv_heads,
        head_dim_k=head_dim_k, head_dim_v=head_dim_v, n_embd=n_embd, n_vocab=n_vocab,
        n_ctx_train=int(key("context_length", 0) or 0), weights_bytes=int(weights_bytes), mtp_layers=mtp,
        mtp_weights_bytes=int(mtp_weights_bytes), mtp_kv_heads=kv_all[-1] if mtp else 0, path=path,
    )


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SKIP_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def read_gguf_metadata(path: str | Path) -> tuple[dict[str, Any], list[tuple[str, int]], int]:
    """(key/values, [(tensor name, bytes)], GGUF version) from the header only.

    A small reader of our own: gguf.GGUFReader materialises every vocabulary entry (10 s for
    a 262K-token vocabulary); this one skips the big tokenizer arrays and records their length.
    """
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise KvmemError(f"cannot open {path}: {exc.strerror}") from None
    with fh:
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise KvmemError(f"{path} is empty", hint="download it again") from None
        pos = 0

        def take(fmt: str):
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            text = bytes(buf[pos:pos + n]).decode("utf-8", errors="replace")
            pos += n
            return text

        def value(vtype: int, keep: bool = True):
            nonlocal pos
            if vtype in _SCALARS:
                return take(_SCALARS[vtype])
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, count = take("<I"), take("<Q")
                if etype in _SCALARS:
                    size = struct.calcsize(_SCALARS[etype])
                    if not keep:
                        pos += size * count
                        return count
                    items = list(struct.unpack_from(f"<{count}{_SCALARS[etype][1]}", buf, pos))
                    pos += size * count
                    return items
                items = [value(etype, keep) for _ in range(count)]
                return items if keep else count
            raise ValueError(f"unknown GGUF value type {vtype}")

        try:
            if bytes(buf[:4]) != b"GGUF":
                raise KvmemError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})",
                                 hint="kvmem runs GGUF models; convert others with llama.cpp's convert_hf_to_gguf.py")
            pos = 4
            version = take("<I")
            if version < 2:
                raise KvmemError(f"{path} is GGUF version {version}, too old for this engine",
                                 hint="convert it again with a current llama.cpp")
            n_tensors, n_kv = take("<Q"), take("<Q")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = string()
                vtype = take("<I")
                keep = key not in _SKIP_ARRAYS
                got = value(vtype, keep)
                meta[key if keep else f"{key}.count"] = got
            tensors = []
            for _ in range(n_tensors):
                name = string()
                dims = [take("<Q") for _ in range(take("<I"))]
                ttype = take("<I")
                take("<Q")  # offset
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
                tensors.append((name, math.prod(dims) // block * type_size))
        except (struct.error, ValueError, IndexError, KeyError) as exc:
            raise KvmemError(f"{path} is not a readable GGUF ({exc})",
                             hint="the file may be truncated: download it again") from None
        finally:
            buf.close()
    meta["GGUF.version"] = version
    return meta, tensors, version


def shape_from_gguf(path: str | Path, name: str | None = None) -> ModelShape:
    meta, tensors, _ = read_gguf_metadata(path)
    arch = str(meta.get("general.architecture", ""))
    mtp = int(meta.get(f"{arch}.nextn_predict_layers", 0))
    n_layer = int(meta.get(f"{arch}.block_count", 0)) - mtp
    mtp_prefixes = tuple(f"blk.{i}." for i in range(n_layer, n_layer + mtp))
    mtp_bytes = sum(b for n, b in tensors if mtp_prefixes and n.startswith(mtp_prefixes))
    return shape_from_metadata(meta, sum(b for _, b in tensors), mtp_bytes, name=name, path=str(path))


@dataclass
class Profile:
    """What the launcher turns into llama-server flags."""

    device: str  # "gpu" or "cpu"
    ctx: int
    budget: int  # GPU KV working set in tokens; 0 = tiering off
    gen_reserve: int
    block: int
    ctk: str
    ctv: str
    host_mib: int
    draft_mtp: bool
    n_gpu_layers: int | None  # None = all (GPU) / not applicable (CPU)


@dataclass
class Plan:
    model: ModelShape
    profile: Profile
    ledger: list[tuple[str, int | None, str]]  # (item, bytes, note)
    kv_per_token: dict[str, int]
    vram: int | None
    ram_available: int
    warnings: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)  # what to lower, in order

    @property
    def fits(self) -> bool:
        return not self.fixes

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ledger"] = [{"item": i, "bytes": b, "note": n} for i, b, n in self.ledger]
        out["fits"] = self.fits
        return out


def kv_table(shape: ModelShape) -> dict[str, int]:
    """KV bytes per token for every cache type this model's head sizes allow."""
    table = {}
    for cache_type in CACHE_TYPES:
        try:
            table[cache_type] = shape.kv_bytes_per_token(cache_type)
        except KvmemError:
            continue
    return table


def _floor_to(value: int, step: int) -> int:
    return max(0, value // step * step)


def _cache_pair(ctk: str | None, ctv: str | None) -> list[tuple[str, str]]:
    if ctk or ctv:
        return [(ctk or ctv or "f16", ctv or ctk or "f16")]
    return [(t, t) for t in AUTO_CACHE_TYPES]


def _gpu_kv_choice(shape: ModelShape, kv_room: int, ctx: int, gen_reserve: int,
                   pairs: list[tuple[str, str]]) -> tuple[str, str, int, bool]:
    """(ctk, ctv, budget, acceptable) for the first cache type that holds ctx or keeps ctx <= 6x budget."""
    choice = None
    for ctk, ctv in pairs:
        per_token = shape.kv_bytes_per_token(ctk, ctv)
        if per_token * ctx <= kv_room:
            return ctk, ctv, 0, True  # the whole context fits: no tiering needed
        budget = _floor_to(kv_room // per_token - gen_reserve, BLOCK_TOKENS)
        choice = (ctk, ctv, budget, budget > 0 and ctx <= CTX_PER_BUDGET * budget)
        if choice[3]:
            return choice
    assert choice is not None
    return choice


def plan(shape: ModelShape, hw: Hardware, *, ctx: int | None = None, ctk: str | None = None,
         ctv: str | None = None, draft_mtp: bool | None = None, gen_reserve: int | None = None,
         gpu_index: int = 0) -> Plan:
    """The profile for running `shape` on `hw` at `ctx` tokens (default: the trained context)."""
    ctx = int(ctx or shape.n_ctx_train or 4096)
    gpu = hw.gpu(gpu_index)
    per_type = kv_table(shape)
    compute = shape.compute_buffer_bytes()
    if gpu is None:
        return _plan_cpu(shape, hw, ctx, ctk or "f16", ctv or ctk or "f16", per_type, compute)

    vram = gpu.vram_free
    reserve = DEFAULT_GEN_RESERVE if gen_reserve is None else gen_reserve
    reserve = min(reserve, max(BLOCK_TOKENS, ctx // 8))
    pairs = _cache_pair(ctk, ctv)
    trunk = shape.trunk_weights_bytes
    warnings: list[str] = []
    fixes: list[str] = []

    def attempt(with_mtp: bool):
        mtp_weights = shape.mtp_weights_bytes if with_mtp else 0
        room = vram - trunk - compute - GPU_OVERHEAD - mtp_weights
        if with_mtp:  # the draft's KV follows the target's working set; reserve it for ctx/6 cells
            room -= shape.mtp_kv_bytes_per_token(*pairs[-1]) * min(ctx, ctx // CTX_PER_BUDGET + reserve)
        if room <= 0:
            return room, None
        return room, _gpu_kv_choice(shape, room, ctx, reserve, pairs)

    use_mtp = bool(shape.mtp_layers) and draft_mtp is not False
    room, choice = attempt(use_mtp)
    if use_mtp and (choice is None or not choice[3]) and draft_mtp is None:
        use_mtp = False  # MTP speeds decode up, but not at the price of the working set
        room, choice = attempt(False)
    if draft_mtp and not shape.mtp_layers:
        warnings.append(f"{shape.name} has no MTP head: --spec-type draft-mtp is off")

    ngl: int | None = None
    if choice is None or choice[2] == 0 and not choice[3]:
        # the weights themselves do not fit: offload only some layers, KV stays with them
        fixes = [
            "turn off the MTP draft (--no-draft-mtp)" if use_mtp else None,
            "use a smaller quantization of the model (e.g. IQ3 instead of Q4)",
            "offload fewer layers (-ngl N; the rest run on the CPU, slowly)",
            "close other programs that hold VRAM" if gpu.detected else None,
        ]
        fixes = [f for f in fixes if f]
        usable = vram - compute - GPU_OVERHEAD - MIN_GPU_KV_TOKENS * shape.kv_bytes_per_token(*pairs[-1])
        ngl = max(0, min(shape.n_layer, int(shape.n_layer * usable / trunk))) if trunk else shape.n_layer
        warnings.append(f"weights ({trunk / GiB:.1f} GiB) + compute + KV do not fit in {vram / GiB:.1f} GiB of VRAM; "
                        f"planning {ngl}/{shape.n_layer} layers on the GPU")
        c_k, c_v = pairs[0]
        budget, kv_gpu = 0, ctx * shape.kv_bytes_per_token(c_k, c_v)
    else:
        c_k, c_v, budget, ok = choice
        kv_gpu = shape.kv_bytes_per_token(c_k, c_v) * ((budget + reserve) if budget else ctx)
        if budget and not ok:
            smaller = " or use a smaller KV type (--ctk q5_0)" if c_k in ("f32", "f16", "bf16", "q8_0") else ""
            warnings.append(f"context {ctx} is more than {CTX_PER_BUDGET}x the GPU budget {budget}: "
                            f"retrieval quality falls past that; lower --ctx{smaller}")
    per_token = shape.kv_bytes_per_token(c_k, c_v)
    full_kv = per_token * ctx
    host_mib = math.ceil(full_kv / MiB) if budget else 0
    if budget and host_mib * MiB > hw.ram_available * RAM_HEADROOM:
        warnings.append(f"host RAM is short: the KV pool for {ctx} tokens needs {host_mib} MiB, "
                        f"{hw.ram_available // MiB} MiB are available; lower --ctx or use --ctk q8_0/q5_0")
    mtp_cost = (shape.mtp_weights_bytes + shape.mtp_kv_bytes_per_token(c_k, c_v) * ((budget + reserve) or ctx)
                if use_mtp else 0)
    profile = Profile("gpu", ctx, budget, reserve if budget else 0, BLOCK_TOKENS, c_k, c_v, host_mib, use_mtp, ngl)
    used = trunk + compute + GPU_OVERHEAD + kv_gpu + mtp_cost
    ledger = [
        ("VRAM", vram, f"{gpu.name}" + ("" if gpu.detected else " (given)")),
        ("weights on GPU", trunk if ngl is None else trunk * ngl // max(1, shape.n_layer), shape.name),
        ("compute buffers", compute, f"ubatch {UBATCH}: logits + activations"),
        ("runtime overhead", GPU_OVERHEAD, "CUDA context, workspace"),
        ("KV working set", kv_gpu, f"{(budget + reserve) if budget else ctx} tokens x {per_token} B ({c_k}/{c_v})"),
        ("MTP draft", mtp_cost, "head weights + its KV" if use_mtp else "off"),
        ("VRAM left", vram - used, ""),
        ("full KV at ctx", full_kv, f"{ctx} tokens"),
        ("host KV pool", host_mib * MiB if budget else 0, "tiering on" if budget else "tiering off"),
    ]
    return Plan(shape, profile, ledger, per_type, vram, hw.ram_available, warnings, fixes)


def _plan_cpu(shape: ModelShape, hw: Hardware, ctx: int, ctk: str, ctv: str, per_type: dict[str, int],
              compute: int) -> Plan:
    """No GPU: weights (mmapped), full KV and compute buffers live in RAM; no tiering."""
    per_token = shape.kv_bytes_per_token(ctk, ctv)
    weights = shape.trunk_weights_bytes
    warnings: list[str] = []
    fixes: list[str] = []
    room = int(hw.ram_available * RAM_HEADROOM) - weights - compute
    if per_token * ctx > room:
        fitted = _floor_to(room // per_token, 1024) if per_token else ctx
        if fitted <= 0:
            fixes = ["free host RAM (close programs)", "use a smaller model or quantization"]
            warnings.append(f"the weights ({weights / GiB:.1f} GiB) do not fit in the available RAM "
                            f"({hw.ram_available / GiB:.1f} GiB)")
            fitted = min(ctx, 4096)
        else:
            warnings.append(f"context lowered from {ctx} to {fitted}: the full KV cache must fit in RAM")
        ctx = fitted
    profile = Profile("cpu", ctx, 0, 0, BLOCK_TOKENS, ctk, ctv, 0, False, None)
    ledger = [
        ("RAM available", hw.ram_available, ""),
        ("weights (mmap)", weights, shape.name),
        ("compute buffers", compute, f"ubatch {UBATCH}: logits + activations"),
        ("KV cache", per_token * ctx, f"{ctx} tokens x {per_token} B ({ctk}/{ctv})"),
        ("RAM left", hw.ram_available - weights - compute - per_token * ctx, ""),
    ]
    return Plan(shape, profile, ledger, per_type, None, hw.ram_available, warnings, fixes)
