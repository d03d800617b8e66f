"""GGUF header reading: the one reader of GGUF files in kvmem (format checks, metadata, tensor table).

The header is parsed directly over an mmap using the `gguf` package's constants (value types,
quantization block sizes). `gguf.GGUFReader` gives the same answers but materializes every
tokenizer array as numpy views, which takes seconds for a 150K-token vocabulary; here large
arrays are skipped and only their type and length are kept, so inspecting any model is
milliseconds. tests/test_models_inspect.py cross-checks both readers on a real file. What the
header means for running the model (layers, KV bytes per token) is kvmem_llama.models.gguf_info.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
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


# more(end): grow the buffer in place to at least `end` bytes (a header read over HTTP Range requests)
More = Callable[[int], None]


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes | bytearray, path: Path, size: int, more: More | None = None):
        self.buf, self.pos, self.path, self.size, self.more = buf, 0, path, size, more

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFFormatError(
                f"{self.path}: truncated GGUF header (needs byte {self.pos + n}, file has {self.size})",
                hint="the file is incomplete; download it again (kvmem pull) or re-copy it",
            )
        if self.pos + n > len(self.buf):
            if self.more is None:
                raise GGUFFormatError(f"{self.path}: the header bytes end at {len(self.buf)}, "
                                      f"the header needs byte {self.pos + n}")
            self.more(self.pos + n)

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
            return parse_header(buf, path, size)


def parse_header(buf: mmap.mmap | bytes | bytearray, path: Path, size: int, more: More | None = None) -> GGUFHeader:
    """Parse the header at the start of `buf` for a file of `size` bytes. `buf` may hold only a prefix
    (at least 64 bytes, or the whole file): `more(end)` is then asked to extend it as the header's
    own lengths require, so nothing past the tensor table is ever needed."""
    if buf[:4] != GGUF_MAGIC:
        raise GGUFFormatError(
            f"{path}: not a GGUF file (found {_looks_like(bytes(buf[:64]))})",
            hint="pass a .gguf model file; other formats (safetensors, bin) need converting with llama.cpp",
        )
    cur = _Cursor(buf, path, size, more)
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
