"""cffi (ABI mode) binding of the engine's libllama, with a small Pythonic layer.

    from kvmem_llama.binding import Llama
    with Llama.load("model.gguf", n_ctx=4096) as llm:
        print(llm.generate("The capital of France is", max_tokens=16).text)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cffi

from kvmem_llama.binding.cdef import CDEF
from kvmem_llama.errors import KvmemError

ffi = cffi.FFI()
ffi.cdef(CDEF)

_lib = None
_lib_path: Path | None = None
_lock = threading.Lock()
_log_sink: list[str] = []
_log_level = 4  # ERROR and above reach stderr; everything is kept in _log_sink


@ffi.callback("void(enum ggml_log_level, const char *, void *)")
def _on_log(level: int, text, _user) -> None:  # pragma: no cover - called from C
    line = ffi.string(text).decode("utf-8", errors="replace")
    _log_sink.append(line)
    del _log_sink[:-2000]
    if level >= _log_level and level != 5:
        os.write(2, line.encode())


def load_library(libllama: Path | str | None = None):
    """dlopen libllama once per process (from the given path or the current CPU engine)."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if libllama is not None and Path(libllama).resolve() != _lib_path:
                raise KvmemError(f"libllama is already loaded from {_lib_path}; one engine per process")
            return _lib
        if libllama is None:
            from kvmem_llama.engine import require_engine

            libllama = require_engine("cpu").libllama
        path = Path(libllama).resolve()
        if not path.exists():
            raise KvmemError(f"{path} does not exist", hint="run `kvmem build`")
        _lib = ffi.dlopen(str(path))
        _lib_path = path
        _lib.llama_log_set(_on_log, ffi.NULL)
        # the backend modules (CPU variants, CUDA) live next to the engine's binaries: ggml's own default
        # search looks beside the executable, which is Python here
        _lib.ggml_backend_load_all_from_path(str(path.parent.parent / "bin").encode())
        _lib.llama_backend_init()
        return _lib


def recent_log(n: int = 50) -> list[str]:
    """The engine's last log lines (captured instead of printed)."""
    return _log_sink[-n:]


PREFILL_MODES = {"window": 0, "retrieval": 1}
GPU_TYPES = {"f16": 0, "same": 1}


# the kvmem_* fields of llama_context_params that KvmemConfig sets (its own names)
KVMEM_FIELDS = ("budget", "block", "sink", "recent", "gen_reserve", "query_tokens", "host_mib", "method", "refresh",
                "trace", "prefill", "gpu_type")


def engine_kvmem_defaults(lib=None) -> dict[str, int | bool]:
    """The engine's tiering defaults (llama_context_default_params; llama-kvmem-params.h is their one place)."""
    params = (lib or load_library()).llama_context_default_params()
    return {name: getattr(params, f"kvmem_{name}") for name in KVMEM_FIELDS}


@dataclass(frozen=True)
class KvmemConfig:
    """KV tiering settings of a context (the `--kvmem-*` flags of llama-server / llama-cli). A field left None
    keeps the engine's default (engine_kvmem_defaults)."""

    budget: int = 0  # GPU working-set tokens; 0 = tiering off
    block: int | None = None
    sink: int | None = None
    recent: int | None = None
    gen_reserve: int | None = None
    query_tokens: int | None = None
    host_mib: int | None = None  # 0 = sized for the whole context
    method: str | None = None  # the engine's names: retrieval, recency, quest, meankey, subpage, votes, mass, hybrid
    refresh: int | None = None  # re-select every N generated tokens; 0 = only when the reserve is full
    trace: bool = False
    prefill: str | None = None  # "window" or "retrieval"
    gpu_type: str | None = None  # the working set's type over a quantized pool (type_k/type_v), or "same"

    def apply(self, cparams, lib) -> None:
        values: dict[str, int | bool] = {"budget": self.budget, "trace": self.trace}
        for name in ("block", "sink", "recent", "gen_reserve", "query_tokens", "host_mib", "refresh"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.method is not None:
            method = lib.llama_kvmem_method_from_name(self.method.encode())
            if method < 0:
                raise KvmemError(f"unknown kvmem method {self.method!r}",
                                 hint="retrieval, recency, quest, meankey, subpage, votes, mass or hybrid")
            values["method"] = method
        if self.prefill is not None:
            if self.prefill not in PREFILL_MODES:
                raise KvmemError(f"unknown kvmem prefill mode {self.prefill!r}", hint="window or retrieval")
            values["prefill"] = PREFILL_MODES[self.prefill]
        if self.gpu_type is not None:
            if self.gpu_type not in GPU_TYPES:
                raise KvmemError(f"unknown kvmem GPU working-set type {self.gpu_type!r}", hint="f16 or same")
            values["gpu_type"] = GPU_TYPES[self.gpu_type]
        for name, value in values.items():
            setattr(cparams, f"kvmem_{name}", value)
        problem = ffi.string(lib.llama_kvmem_check_params(ffi.addressof(cparams))).decode()
        if problem:
            raise KvmemError(problem)


@dataclass(frozen=True)
class KvmemStats:
    """llama_kvmem_get_stats: the tiering state of a context."""

    enabled: bool
    budget: int
    block_tokens: int
    blocks_gpu: int
    blocks_host: int
    host_bytes: int
    host_capacity_bytes: int
    selections: int
    staged_in: int
    staged_out: int
    evicted: int
    last_select_ms: float
    blocks_disk: int = 0  # on the disk tier (--kvmem-disk-path)
    disk_bytes: int = 0


@dataclass
class Completion:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stop_reason: str  # "eog" | "length"
    prompt_ms: float
    decode_ms: float
    extra: dict = field(default_factory=dict)

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / (self.decode_ms / 1000) if self.decode_ms else 0.0


def _with_room(kind: str, cap: int, call: Callable) -> tuple:
    """llama.cpp's buffer protocol: a negative result is the room needed; call again with that much."""
    buf = ffi.new(kind, cap)
    n = call(buf, cap)
    if n < 0:
        buf = ffi.new(kind, -n)
        n = call(buf, -n)
    return buf, n


class Llama:
    """A model and one context on it."""

    def __init__(self, model, ctx, lib, path: Path):
        self._model = model
        self._ctx = ctx
        self._lib = lib
        self.path = path
        self.vocab = lib.llama_model_get_vocab(model)
        # model facts, fixed for the model's lifetime
        self.n_ctx = int(lib.llama_n_ctx(ctx))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(model))
        self.n_layer = int(lib.llama_model_n_layer(model))
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))

    @classmethod
    def load(cls, model_path: str | Path, *, n_ctx: int = 4096, n_batch: int = 2048,
             n_threads: int | None = None, n_gpu_layers: int = 0, libllama: Path | str | None = None,
             context_overrides: Callable[[object], None] | None = None,
             kvmem: KvmemConfig | None = None) -> Llama:
        lib = load_library(libllama)
        path = Path(model_path)
        if not path.is_file():
            raise KvmemError(f"model file not found: {path}")
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if model == ffi.NULL:
            tail = "".join(recent_log(8)).strip()
            raise KvmemError(f"the engine could not load {path}:\n{tail}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(512, n_batch)
        threads = n_threads or max(1, os.cpu_count() or 1)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if kvmem is not None:
            kvmem.apply(cparams, lib)
        if context_overrides:
            context_overrides(cparams)
        ctx = lib.llama_init_from_model(model, cparams)
        if ctx == ffi.NULL:
            lib.llama_model_free(model)
            tail = "".join(recent_log(8)).strip()
            raise KvmemError(f"the engine could not create a context (n_ctx={n_ctx}):\n{tail}")
        return cls(model, ctx, lib, path)

    # --- lifecycle ---
    def close(self) -> None:
        if self._ctx is not None:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            self._lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # --- model facts ---
    def describe(self) -> str:
        buf = ffi.new("char[]", 256)
        self._lib.llama_model_desc(self._model, buf, 256)
        return ffi.string(buf).decode()

    # --- text <-> tokens ---
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        buf, n = _with_room("llama_token[]", len(data) + 16, lambda b, cap: self._lib.llama_tokenize(
            self.vocab, data, len(data), b, cap, add_special, parse_special))
        if n < 0:
            raise KvmemError(f"tokenization failed ({n})")
        return list(buf[0:n])

    def token_piece(self, token: int, special: bool = False) -> bytes:
        buf, n = _with_room("char[]", 64, lambda b, cap: self._lib.llama_token_to_piece(
            self.vocab, token, b, cap, 0, special))
        return ffi.buffer(buf, n)[:]

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        arr = ffi.new("llama_token[]", tokens)
        buf, n = _with_room("char[]", max(64, len(tokens) * 8), lambda b, cap: self._lib.llama_detokenize(
            self.vocab, arr, len(tokens), b, cap, False, special))
        return ffi.buffer(buf, n)[:].decode("utf-8", errors="replace")

    # --- KV tiering ---
    def kvmem_stats(self, seq_id: int | None = None) -> KvmemStats:
        """Tiering counters (llama_kvmem_get_stats); enabled=False when tiering is off."""
        st = ffi.new("struct llama_kvmem_stats *")
        if seq_id is None:
            rc = self._lib.llama_kvmem_get_stats(self._ctx, st)
        else:
            rc = self._lib.llama_kvmem_get_seq_stats(self._ctx, seq_id, st)
        if rc < 0:
            raise KvmemError("llama_kvmem_get_stats failed")
        return KvmemStats(
            enabled=rc == 0, budget=st.budget, block_tokens=st.block_tokens, blocks_gpu=st.n_blocks_gpu,
            blocks_host=st.n_blocks_host, host_bytes=st.host_bytes, host_capacity_bytes=st.host_capacity_bytes,
            selections=st.n_selections, staged_in=st.n_staged_in, staged_out=st.n_staged_out,
            evicted=st.n_evicted, last_select_ms=st.last_select_ms, blocks_disk=st.n_blocks_disk,
            disk_bytes=st.disk_bytes,
        )

    def kvmem_last_error(self) -> str:
        return ffi.string(self._lib.llama_kvmem_last_error(self._ctx)).decode("utf-8", errors="replace")

    # --- evaluation ---
    def reset(self) -> None:
        """Forget everything in the context's memory (KV cache)."""
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)

    def decode(self, tokens: list[int], n_batch: int = 2048) -> None:
        """Evaluate tokens, continuing the sequence; logits of the last one are kept."""
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            arr = ffi.new("llama_token[]", chunk)
            rc = self._lib.llama_decode(self._ctx, self._lib.llama_batch_get_one(arr, len(chunk)))
            if rc != 0:
                tail = "".join(recent_log(6)).strip()
                reason = {1: "no free KV slot (context full)", 2: "aborted"}.get(rc, f"error {rc}")
                kv_err = self.kvmem_last_error()
                if kv_err:
                    reason = kv_err
                raise KvmemError(f"llama_decode failed: {reason}\n{tail}")

    def _sampler(self, temperature: float, top_k: int, top_p: float, seed: int):
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if temperature <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def stream(self, prompt: str | list[int], max_tokens: int = 128, *, temperature: float = 0.0,
               top_k: int = 40, top_p: float = 0.95, seed: int = 0,
               stats: dict | None = None) -> Iterator[int]:
        """Yield generated token ids; fills `stats` with prompt/decode timings."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if len(tokens) + max_tokens > self.n_ctx:
            raise KvmemError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed the context ({self.n_ctx})"
            )
        sampler = self._sampler(temperature, top_k, top_p, seed)
        stats = stats if stats is not None else {}
        try:
            t0 = time.perf_counter()
            self.decode(tokens)
            t1 = time.perf_counter()
            stats.update(prompt_tokens=len(tokens), prompt_ms=(t1 - t0) * 1000, stop_reason="length")
            for _ in range(max_tokens):
                token = int(self._lib.llama_sampler_sample(sampler, self._ctx, -1))
                if self._lib.llama_vocab_is_eog(self.vocab, token):
                    stats["stop_reason"] = "eog"
                    break
                yield token
                self.decode([token])
            stats["decode_ms"] = (time.perf_counter() - t1) * 1000
        finally:
            self._lib.llama_sampler_free(sampler)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, **kw) -> Completion:
        stats: dict = {}
        out = list(self.stream(prompt, max_tokens, stats=stats, **kw))
        return Completion(
            text=self.detokenize(out),
            tokens=out,
            prompt_tokens=stats.get("prompt_tokens", 0),
            stop_reason=stats.get("stop_reason", "length"),
            prompt_ms=stats.get("prompt_ms", 0.0),
            decode_ms=stats.get("decode_ms", 0.0),
        )
