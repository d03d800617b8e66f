"""GGUF header reading: format checks and the model facts kvmem needs (layers, heads, KV bytes per token).

The header is parsed directly over an mmap using the `gguf` package's constants (value types,
quantization block sizes). `gguf.GGUFReader` gives the same answers but materializes every
tokenizer array as numpy views, which takes seconds for a 150K-token vocabulary; here large
arrays are skipped and only their type and length are kept, so inspecting any model is
milliseconds. tests/test_models_inspect.py cross-checks both readers on a real file.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from kvmem_llama.errors import KvmemError

GGUF_MAGIC = b"GGUF"
READABLE_VERSIONS = (2, 3)  # what llama.cpp (and so this engine) loads; v1 was dropped upstream
SMALL_ARRAY = 4096  # arrays up to this many elements are read (per-layer tables); larger ones only sized

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}

# K/V cache element types reported by inspect (block size, bytes per block) from the gguf package.
KV_CACHE_TYPES = ("f16", "q8_0", "q5_0", "q4_0")

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


class GGUFFormatError(KvmemError):
    """The file is not a GGUF this engine can read (wrong magic, version, truncated, ...)."""


@dataclass(frozen=True)
class ArrayInfo:
    """A large metadata array that was skipped, not read."""

    type: str
    count: int


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type: str
    offset: int
    nbytes: int | None  # None for a quantization type the gguf package does not know


@dataclass
class GGUFHeader:
    path: Path
    version: int
    file_size: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))


def _looks_like(head: bytes) -> str:
    text = head.lstrip().lower()
    if text.startswith((b"<!doctype html", b"<html")):
        return "an HTML page (an error page saved as the model?)"
    if text.startswith((b"{", b"[")):
        return "JSON text (an API error answer?)"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer file, not the model itself"
    if head.startswith(b"PK"):
        return "a zip archive"
    if head[:4] in (b"\x00\x00\x00\x00", b""):
        return "zeros / empty data"
    return f"bytes {head[:8]!r}"


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path, size: int):
        self.buf, self.pos, self.path, self.size = buf, 0, path, size

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFFormatError(
                f"{self.path}: truncated GGUF header (needs byte {self.pos + n}, file has {self.size})",
                hint="the file is incomplete; download it again (kvmem pull) or re-copy it",
            )

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 30:
            raise GGUFFormatError(f"{self.path}: corrupt GGUF header (string of {n} bytes at {self.pos - 8})")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.need(n)
        self.pos += n

    def value(self, vtype: int) -> Any:
        try:
            t = GGUFValueType(vtype)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}") from None
        if t == GGUFValueType.STRING:
            return self.string()
        if t == GGUFValueType.ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            try:
                et = GGUFValueType(etype)
            except ValueError:
                raise GGUFFormatError(f"{self.path}: unknown GGUF array type {etype}") from None
            if et == GGUFValueType.ARRAY:
                raise GGUFFormatError(f"{self.path}: nested GGUF arrays are not supported")
            if count <= SMALL_ARRAY:
                return [self.value(etype) for _ in range(count)]
            if et == GGUFValueType.STRING:
                for _ in range(count):
                    self.skip_string()
            else:
                n = struct.calcsize(_SCALAR[et]) * count
                self.need(n)
                self.pos += n
            return ArrayInfo(et.name.lower(), count)
        return self.unpack(_SCALAR[t])


def tensor_nbytes(shape: tuple[int, ...], type_id: int) -> int | None:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def read_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF header; raise GGUFFormatError with what was found if it is not a readable GGUF."""
    path = Path(path)
    if not path.is_file():
        raise KvmemError(f"no such model file: {path}")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if size < 24:
            head = fh.read(64)
            raise GGUFFormatError(
                f"{path}: not a GGUF file ({size} bytes; found {_looks_like(head)})",
                hint="the file is empty or truncated; download it again",
            )
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size)


def _parse(buf: mmap.mmap, path: Path, size: int) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise GGUFFormatError(
            f"{path}: not a GGUF file (found {_looks_like(bytes(buf[:64]))})",
            hint="pass a .gguf model file; other formats (safetensors, bin) need converting with llama.cpp",
        )
    cur = _Cursor(buf, path, size)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in READABLE_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in READABLE_VERSIONS:
            raise GGUFFormatError(f"{path}: big-endian GGUF (v{swapped}); this engine reads little-endian files only",
                                  hint="use a little-endian conversion of the model")
        if version == 1:
            raise GGUFFormatError(f"{path}: GGUF version 1 is no longer readable by llama.cpp",
                                  hint="re-convert the model with a current llama.cpp convert script")
        raise GGUFFormatError(
            f"{path}: GGUF version {version}, but this engine reads versions "
            f"{'/'.join(map(str, READABLE_VERSIONS))}",
            hint="update kvmem-llama (a newer engine), or use a file converted for current llama.cpp",
        )
    n_tensors = cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise GGUFFormatError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    tensors: list[TensorInfo] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise GGUFFormatError(f"{path}: corrupt tensor info for {name!r} ({n_dims} dims)")
        shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
        type_id = cur.unpack("<I")
        offset = cur.unpack("<Q")
        try:
            type_name = GGMLQuantizationType(type_id).name
        except ValueError:
            type_name = f"type{type_id}"
        tensors.append(TensorInfo(name, shape, type_name, offset, tensor_nbytes(shape, type_id)))
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT) or GGUF_DEFAULT_ALIGNMENT)
    data_offset = (cur.pos + align - 1) // align * align
    end = max((t.offset + t.nbytes for t in tensors if t.nbytes is not None), default=0)
    if data_offset + end > size:
        raise GGUFFormatError(
            f"{path}: truncated GGUF: tensor data needs {data_offset + end} bytes, the file has {size}",
            hint="the file is incomplete (an interrupted copy or download); fetch it again",
        )
    return GGUFHeader(path, version, size, metadata, tensors, data_offset)


def check_gguf(path: str | Path) -> GGUFHeader:
    """The magic/version/size check run after every download and import."""
    return read_header(path)


@dataclass
class ModelInfo:
    """What `kvmem inspect` shows; also stored in the model store's records."""

    path: str
    file_size: int
    gguf_version: int
    name: str | None
    arch: str
    n_layers: int  # main-model blocks (MTP/nextn blocks excluded)
    n_attention_layers: int
    n_recurrent_layers: int
    attention_layers: list[int]
    n_heads: int | None
    n_kv_heads: int | None
    head_dim_k: int | None
    head_dim_v: int | None
    embedding_length: int | None
    native_ctx: int | None
    sliding_window: int | None
    rope: dict[str, Any]
    file_type: int | None
    n_tensors: int
    n_params: int
    quant_mix: dict[str, dict[str, int]]  # type -> {"tensors": n, "bytes": b}, largest first
    mtp_layers: int  # nextn / multi-token-prediction blocks in the file
    swa_layers: list[int] = field(default_factory=list)  # attention layers limited to the sliding window
    kv_bytes_per_token: dict[str, float] = field(default_factory=dict)  # all attention layers, K+V
    # growth per token past the sliding window (non-SWA attention layers only); == kv_bytes_per_token without SWA
    kv_bytes_per_token_full_attention: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def quant_summary(self, top: int = 3) -> str:
        total = sum(v["bytes"] for v in self.quant_mix.values()) or 1
        parts = [f"{k} {100 * v['bytes'] / total:.0f}%" for k, v in list(self.quant_mix.items())[:top]]
        return " ".join(parts)


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


def kv_bytes_per_token(n_kv_heads_per_layer: list[int], head_dim_k: int, head_dim_v: int) -> dict[str, float]:
    """K+V cache bytes per token over the given (attention) layers for each KV cache type."""
    out: dict[str, float] = {}
    for name in KV_CACHE_TYPES:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
        elems = sum(h * (head_dim_k + head_dim_v) for h in n_kv_heads_per_layer)
        out[name] = elems * size / block
    return out


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
    n_heads_l = _per_layer(key("attention.head_count"), n_layers) or []
    n_kv_l = _per_layer(key("attention.head_count_kv"), n_layers) or list(n_heads_l)
    n_embd = _as_int(key("embedding_length"))
    n_heads = max(n_heads_l) if n_heads_l else None
    head_k = _as_int(key("attention.key_length")) or (n_embd // n_heads if n_embd and n_heads else None)
    head_v = _as_int(key("attention.value_length")) or head_k

    # Which layers keep a KV cache: explicit recurrent table, interval rule, or per-layer KV heads of 0.
    recurrent = key("attention.recurrent_layers")
    if isinstance(recurrent, list) and recurrent:
        is_recr = [bool(x) for x in recurrent][:n_layers]
    elif arch in _INTERVAL_ARCHS:
        interval = _as_int(key("full_attention_interval")) or 4
        is_recr = [(i + 1) % interval != 0 for i in range(n_layers)]
    elif arch in _RECURRENT_ARCHS:
        is_recr = [True] * n_layers
    else:
        is_recr = [kv == 0 for kv in n_kv_l] if n_kv_l else [False] * n_layers
    is_recr += [False] * (n_layers - len(is_recr))
    attn = [i for i in range(n_layers) if not is_recr[i]]
    kv_heads_attn = [n_kv_l[i] if i < len(n_kv_l) else 0 for i in attn]
    n_kv = max(kv_heads_attn) if kv_heads_attn else (max(n_kv_l) if n_kv_l else None)

    rope = {k.split(".rope.", 1)[1]: v for k, v in m.items()
            if k.startswith(f"{arch}.rope.") and not isinstance(v, ArrayInfo)}

    mix: Counter[str] = Counter()
    count: Counter[str] = Counter()
    n_params = 0
    for t in h.tensors:
        count[t.type] += 1
        mix[t.type] += t.nbytes or 0
        p = 1
        for d in t.shape:
            p *= d
        n_params += p
    quant_mix = {k: {"tensors": count[k], "bytes": mix[k]} for k, _ in mix.most_common()}

    window = _as_int(key("attention.sliding_window")) or 0
    swa: list[int] = []
    if window > 0:
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            swa = [i for i in attn if i < len(pattern) and bool(pattern[i])]
        elif arch in _SWA_PATTERNS or _as_int(pattern) is not None:
            n, dense_first = _SWA_PATTERNS.get(arch, (0, False))
            if _as_int(pattern) is not None:
                n = _as_int(pattern)
            # llama_hparams::set_swa_pattern: n == 0 means every layer is SWA
            swa = [i for i in attn if n == 0 or (i % n != 0 if dense_first else i % n < n - 1)]
    full = [i for i in attn if i not in set(swa)]
    kv = kv_bytes_per_token(kv_heads_attn, head_k, head_v) if head_k and head_v else {}
    kv_full = kv_bytes_per_token([n_kv_l[i] if i < len(n_kv_l) else 0 for i in full], head_k, head_v) \
        if head_k and head_v else {}
    return ModelInfo(
        path=str(h.path), file_size=h.file_size, gguf_version=h.version,
        name=m.get("general.name") if isinstance(m.get("general.name"), str) else None,
        arch=arch, n_layers=n_layers, n_attention_layers=len(attn), n_recurrent_layers=n_layers - len(attn),
        attention_layers=attn, n_heads=n_heads, n_kv_heads=n_kv, head_dim_k=head_k, head_dim_v=head_v,
        embedding_length=n_embd, native_ctx=_as_int(key("context_length")),
        sliding_window=_as_int(key("attention.sliding_window")), rope=rope,
        file_type=_as_int(m.get("general.file_type")), n_tensors=len(h.tensors), n_params=n_params,
        quant_mix=quant_mix, mtp_layers=mtp, swa_layers=swa, kv_bytes_per_token=kv,
        kv_bytes_per_token_full_attention=kv_full,
    )
