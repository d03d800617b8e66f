"""The VRAM ledger: from a model's `ModelInfo` (GGUF header) + hardware to a launch profile.

KV bytes per token count only layers that have a KV cache (a hybrid `qwen35` model has 16
full-attention layers out of 64; the rest are recurrent and keep a fixed-size state); see
kvmem_llama.models.gguf_info for the arithmetic. Qwen3.8-27B: 64 KiB per token at f16.

The estimates of compute buffers and overhead are deliberately simple formulas (documented at
their constants) so the plan can be checked by hand; they err on the generous side.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvmem_llama.errors import KvmemError
from kvmem_llama.hardware import Hardware
from kvmem_llama.models import NotDownloaded, remote_header, resolve_model, vision_projector
from kvmem_llama.models.gguf_info import SUMMARY_CHUNK_TOKENS, ModelInfo, model_info

MiB = 1 << 20
GiB = 1 << 30

# Automatic KV type choice, fastest first: quantized KV makes long-context decode slower
# (measured: 27B at 32K, f16 97 tok/s vs q5_0 68), so it is used only when f16 would shrink
# the working set past the 6x rule.
AUTO_CACHE_TYPES = ("f16", "q8_0", "q5_0")
UNQUANTIZED = ("f32", "f16", "bf16")
CTX_PER_BUDGET = 6  # the anchor's rule of thumb: quality falls when context > 6x the GPU budget
BLOCK_TOKENS = 128
UBATCH = 512
GPU_OVERHEAD = 512 * MiB  # CUDA context, cuBLAS workspace, allocator slack
DEFAULT_GEN_RESERVE = 4096
MIN_GPU_KV_TOKENS = 4096  # below this a GPU plan is not worth it
RAM_HEADROOM = 0.9  # plan to use at most 90% of available RAM


def compute_buffer_bytes(info: ModelInfo, ubatch: int = UBATCH) -> int:
    """Estimate: f32 logits for one ubatch plus ~4 activations of width n_embd per token."""
    return 4 * ubatch * ((info.n_vocab or 0) + 4 * (info.embedding_length or 0))


@dataclass
class Profile:
    """What serving.argv turns into llama-server flags."""

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
    # with tiering, the GPU working set's KV type over a quantized pool (ctk/ctv): "f16" (the engine's
    # default) or "same" (the pool's type, for a budget the f16 working set cannot reach)
    gpu_type: str = "f16"
    # where selection scores the block summaries: "device" (next to the working set) or "host" (host RAM + CPU)
    score_on: str = "device"


@dataclass
class Plan:
    model: ModelInfo
    label: str  # the model's name in the ledger (its alias, else its file name)
    profile: Profile
    ledger: list[tuple[str, int | None, str]]  # (item, bytes, note)
    kv_per_token: dict[str, int]
    vram: int | None
    ram_available: int
    warnings: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)  # what to lower, in order
    # a hub model planned from its header alone: repo, file, size, sha256, header_bytes, fetched_bytes, cached
    not_downloaded: dict | None = None

    @property
    def fits(self) -> bool:
        return not self.fixes

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ledger"] = [{"item": i, "bytes": b, "note": n} for i, b, n in self.ledger]
        out["fits"] = self.fits
        return out


def _weights_warnings(info: ModelInfo) -> list[str]:
    if not info.unknown_tensor_types:
        return []
    return [f"tensors of type {', '.join(info.unknown_tensor_types)} have a size this gguf package does not know: "
            "the weights are counted without them (a newer `gguf` package knows more types)"]


def _floor_to(value: int, step: int) -> int:
    return max(0, value // step * step)


def working_type(cache_type: str, gpu_type: str) -> str:
    """The working set's KV type under tiering (--kvmem-gpu-type): f16 over a quantized pool, or the same."""
    return "f16" if gpu_type == "f16" and cache_type not in UNQUANTIZED else cache_type


def _cache_choices(ctk: str | None, ctv: str | None, gpu_type: str | None) -> list[tuple[str, str, str]]:
    """(pool K type, pool V type, working-set type rule) to try, in order. Given types are used as they are
    (their working set f16 unless gpu_type says same); the automatic ones grow the budget by quantizing the
    working set too, since an f16 working set over a smaller pool would hold no more tokens."""
    if ctk or ctv:
        return [(ctk or ctv or "f16", ctv or ctk or "f16", gpu_type or "f16")]
    return [(t, t, gpu_type or ("f16" if t in UNQUANTIZED else "same")) for t in AUTO_CACHE_TYPES]


def _working_bytes(info: ModelInfo, choice: tuple[str, str, str]) -> int:
    ctk, ctv, gpu_type = choice
    return info.kv_bytes(working_type(ctk, gpu_type), working_type(ctv, gpu_type))


STAGING_BYTES = 64 * MiB  # the engine's staging buffer for block copies (llama-kvmem-pool.cpp)
SCORE_STEP_BYTES = 96 * MiB  # the scoring graph's bound on one step's attention matrix (llama-kvmem-summaries.h)
QUERY_TOKENS = 128  # --kvmem-query-tokens' default: a re-selection scores 1.5x as many query rows


def summary_bytes(info: ModelInfo, ctx: int) -> int:
    """VRAM of scoring on the GPU: the block summaries (the engine sizes them for every block of the host pool),
    the scoring graph's memory, taken at startup for the largest selection (one layer's summaries gathered as f32,
    one step's attention matrix), the query rows of a re-selection (one question's and its newest rows, kept on
    the device whatever the number of slots: the others' wait in host memory), and the staging buffer."""
    tokens = (ctx // BLOCK_TOKENS + 2) * BLOCK_TOKENS
    summaries = info.summary_bytes_per_token * tokens
    layers = max(1, info.n_attention_layers)
    heads = info.n_heads or 0
    rows = QUERY_TOKENS + QUERY_TOKENS // 2
    attention = min(SCORE_STEP_BYTES, rows * (tokens // SUMMARY_CHUNK_TOKENS) * heads * 4)
    query_rows = rows * heads * (info.head_dim_k or 0) * layers * 4
    return summaries + 2 * summaries // layers + attention + query_rows + STAGING_BYTES


def _gpu_kv_choice(info: ModelInfo, kv_room: int, ctx: int, gen_reserve: int,
                   choices: list[tuple[str, str, str]]) -> tuple[tuple[str, str, str], int, bool, str]:
    """(cache choice, budget, acceptable, score_on) for the first choice that holds ctx or keeps ctx <= 6x budget.
    With tiering, selection scores on the GPU (milliseconds per turn) when the block summaries fit beside an
    acceptable working set of any cache choice; only when none does are they kept in host RAM (scored on the CPU,
    seconds per turn at 256K)."""
    best = None
    for score_on in ("device", "host"):
        for choice in choices:
            if info.kv_bytes(choice[0], choice[1]) * ctx <= kv_room:
                return choice, 0, True, "device"  # the whole context fits: no tiering needed
            room = kv_room - (summary_bytes(info, ctx) if score_on == "device" else 0)
            budget = _floor_to(room // _working_bytes(info, choice) - gen_reserve, BLOCK_TOKENS)
            best = (choice, budget, budget > 0 and ctx <= CTX_PER_BUDGET * budget, score_on)
            if best[2]:
                return best
    assert best is not None
    return best


def plan_model(model: str | None, hw: Hardware, mmproj: str = "", **options) -> Plan:
    """Resolve a model name or path (None: the default model), read its header and plan it on `hw`, with the
    vision projector `mmproj` (a path, `none`, or empty: the pulled one its catalog entry names).

    A hub model that is not downloaded is planned from its GGUF header, read over HTTP Range requests;
    the plan's `not_downloaded` then says what the download would be."""
    try:
        resolved = resolve_model(model)
    except NotDownloaded as missing:
        remote = remote_header(missing.name)
        result = plan(model_info(remote.header), hw, label=missing.alias or f"{remote.repo}:{remote.file}", **options)
        result.not_downloaded = remote.summary()
        return result
    projector, note = vision_projector(resolved, mmproj)
    result = plan(model_info(resolved.path), hw, label=resolved.name,
                  mmproj_bytes=projector.stat().st_size if projector else 0, **options)
    if note:
        result.warnings.append(note)
    return result


def plan(info: ModelInfo, hw: Hardware, *, ctx: int | None = None, ctk: str | None = None,
         ctv: str | None = None, draft_mtp: bool | None = None, gen_reserve: int | None = None,
         gpu_index: int = 0, label: str | None = None, gpu_type: str | None = None, mmproj_bytes: int = 0,
         mmproj_offload: bool = True) -> Plan:
    """The profile for running the model on `hw` at `ctx` tokens (default: the trained context).

    With tiering the KV lives in two tiers: the GPU working set (budget + reserve tokens, f16 over a
    quantized -ctk/-ctv unless gpu_type is "same") and the host pool (the whole context, -ctk/-ctv).
    `mmproj_bytes`: a vision projector's weights, in VRAM before the working set (`mmproj_offload`) or in RAM."""
    if info.n_layers <= 0:
        raise KvmemError(f"{info.path} has no {info.arch}.block_count: no layers to plan",
                         hint="is this a model file (and not e.g. a vocabulary-only GGUF)?")
    label = label or info.name or info.arch
    ctx = int(ctx or info.native_ctx or 4096)
    gpu = hw.gpu(gpu_index)
    compute = compute_buffer_bytes(info)
    if gpu is None:
        return _plan_cpu(info, label, hw, ctx, ctk or "f16", ctv or ctk or "f16", compute, mmproj_bytes)

    vram = gpu.vram_free
    vision_gpu = mmproj_bytes if mmproj_offload else 0
    reserve = DEFAULT_GEN_RESERVE if gen_reserve is None else gen_reserve
    reserve = min(reserve, max(BLOCK_TOKENS, ctx // 8))
    choices = _cache_choices(ctk, ctv, gpu_type)
    trunk = info.trunk_weights_bytes
    warnings = _weights_warnings(info)
    fixes: list[str] = []

    def attempt(with_mtp: bool):
        mtp_weights = info.mtp_weights_bytes if with_mtp else 0
        room = vram - trunk - compute - GPU_OVERHEAD - mtp_weights - vision_gpu
        if with_mtp:  # the draft's KV follows the target's working set; reserve it for ctx/6 cells
            room -= info.mtp_kv_bytes(*choices[-1][:2]) * min(ctx, ctx // CTX_PER_BUDGET + reserve)
        if room <= 0:
            return room, None
        return room, _gpu_kv_choice(info, room, ctx, reserve, choices)

    use_mtp = bool(info.mtp_layers) and draft_mtp is not False
    room, choice = attempt(use_mtp)
    if use_mtp and (choice is None or not choice[2]) and draft_mtp is None:
        use_mtp = False  # MTP speeds decode up, but not at the price of the working set
        room, choice = attempt(False)
    if draft_mtp and not info.mtp_layers:
        warnings.append(f"{label} has no MTP head: --spec-type draft-mtp is off")

    ngl: int | None = None
    if choice is None or choice[1] == 0 and not choice[2]:
        # the weights themselves do not fit: offload only some layers, KV stays with them
        fixes = [
            "turn off the MTP draft (--no-draft-mtp)" if use_mtp else None,
            "keep the vision projector in RAM (-- --no-mmproj-offload: images encode on the CPU, seconds each)"
            if vision_gpu else None,
            "use a smaller quantization of the model (e.g. IQ3 instead of Q4)",
            "offload fewer layers (-ngl N; the rest run on the CPU, slowly)",
            "close other programs that hold VRAM" if gpu.detected else None,
        ]
        fixes = [f for f in fixes if f]
        usable = vram - compute - GPU_OVERHEAD - MIN_GPU_KV_TOKENS * info.kv_bytes(*choices[-1][:2])
        ngl = max(0, min(info.n_layers, int(info.n_layers * usable / trunk))) if trunk else info.n_layers
        warnings.append(f"weights ({trunk / GiB:.1f} GiB) + compute + KV do not fit in {vram / GiB:.1f} GiB of VRAM; "
                        f"planning {ngl}/{info.n_layers} layers on the GPU")
        c_k, c_v, g_type = choices[0]
        budget, kv_gpu, score_on = 0, ctx * info.kv_bytes(c_k, c_v), "device"
    else:
        (c_k, c_v, g_type), budget, ok, score_on = choice
        kv_gpu = _working_bytes(info, (c_k, c_v, g_type)) * (budget + reserve) if budget else \
            info.kv_bytes(c_k, c_v) * ctx
        if budget and not ok:
            smaller = " or use a smaller KV type (--ctk q5_0)" if c_k in ("f32", "f16", "bf16", "q8_0") else ""
            warnings.append(f"context {ctx} is more than {CTX_PER_BUDGET}x the GPU budget {budget}: "
                            f"retrieval quality falls past that; lower --ctx{smaller}")
    if budget and score_on == "host":
        warnings.append(f"selection scores on the CPU (seconds per turn at {ctx} tokens): the block summaries "
                        f"({summary_bytes(info, ctx) / GiB:.1f} GiB) do not fit in VRAM beside the working set; "
                        "a smaller --ctx, KV type or --kvmem-gpu-type same keeps them on the GPU")
    per_token = info.kv_bytes(c_k, c_v)
    w_k, w_v = (working_type(c_k, g_type), working_type(c_v, g_type)) if budget else (c_k, c_v)
    ws_per_token = info.kv_bytes(w_k, w_v)
    full_kv = per_token * ctx
    host_mib = math.ceil(full_kv / MiB) if budget else 0
    if budget and host_mib * MiB > hw.ram_available * RAM_HEADROOM:
        warnings.append(f"host RAM is short: the KV pool for {ctx} tokens needs {host_mib} MiB, "
                        f"{hw.ram_available // MiB} MiB are available; lower --ctx or use --ctk q8_0/q5_0")
    mtp_cost = (info.mtp_weights_bytes + info.mtp_kv_bytes(w_k, w_v) * ((budget + reserve) or ctx)
                if use_mtp else 0)
    profile = Profile("gpu", ctx, budget, reserve if budget else 0, BLOCK_TOKENS, c_k, c_v, host_mib, use_mtp, ngl,
                      g_type, score_on)
    summaries = summary_bytes(info, ctx) if budget and score_on == "device" else 0
    used = trunk + compute + GPU_OVERHEAD + kv_gpu + mtp_cost + summaries + vision_gpu
    if vision_gpu and budget and ws_per_token:
        warnings.append(f"the vision projector ({vision_gpu / GiB:.2f} GiB) takes the room of "
                        f"{vision_gpu // ws_per_token:,} working-set tokens; -- --no-mmproj-offload keeps it in RAM "
                        "(images then encode on the CPU: seconds each instead of milliseconds)")
    vision_rows = [] if not mmproj_bytes else [
        ("vision projector", vision_gpu, "weights; its compute buffer grows with the image size") if vision_gpu
        else ("vision projector", 0, "in RAM (--no-mmproj-offload)")]
    ledger = [
        ("VRAM", vram, f"{gpu.name}" + ("" if gpu.detected else " (given)")),
        ("weights on GPU", trunk if ngl is None else trunk * ngl // max(1, info.n_layers), label),
        ("compute buffers", compute, f"ubatch {UBATCH}: logits + activations"),
        ("runtime overhead", GPU_OVERHEAD, "CUDA context, workspace"),
        ("KV working set", kv_gpu, f"{(budget + reserve) if budget else ctx} tokens x {ws_per_token} B ({w_k}/{w_v})"),
        ("MTP draft", mtp_cost, "head weights + its KV" if use_mtp else "off"),
        *vision_rows,
        ("block summaries", summaries, "tiering off" if not budget else
         f"{ctx} tokens x {info.summary_bytes_per_token} B (f16 8-token key means), scored on the GPU; "
         "with the scoring scratch and the staging buffer"
         if score_on == "device" else "in host RAM, scored on the CPU: no room beside the working set"),
        ("VRAM left", vram - used, ""),
        ("full KV at ctx", full_kv, f"{ctx} tokens"),
        ("host KV pool", host_mib * MiB if budget else 0,
         f"{ctx} tokens x {per_token} B ({c_k}/{c_v})" if budget else "tiering off"),
    ]
    return Plan(info, label, profile, ledger, info.kv_bytes_per_token, vram, hw.ram_available, warnings, fixes)


def _plan_cpu(info: ModelInfo, label: str, hw: Hardware, ctx: int, ctk: str, ctv: str, compute: int,
              mmproj_bytes: int = 0) -> Plan:
    """No GPU: weights (mmapped), full KV and compute buffers live in RAM; no tiering."""
    per_token = info.kv_bytes(ctk, ctv)
    weights = info.trunk_weights_bytes + mmproj_bytes
    warnings = _weights_warnings(info)
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
        ("weights (mmap)", weights, label + (f" + vision projector {mmproj_bytes / MiB:.0f} MiB"
                                              if mmproj_bytes else "")),
        ("compute buffers", compute, f"ubatch {UBATCH}: logits + activations"),
        ("KV cache", per_token * ctx, f"{ctx} tokens x {per_token} B ({ctk}/{ctv})"),
        ("RAM left", hw.ram_available - weights - compute - per_token * ctx, ""),
    ]
    return Plan(info, label, profile, ledger, info.kv_bytes_per_token, None, hw.ram_available, warnings, fixes)
