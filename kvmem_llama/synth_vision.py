"""Synthetic multimodal projector (mmproj) GGUFs: a Qwen3.5-style vision tower, random weights, valid shapes.

Companion of `synth` (the text GGUFs): `synthesize_mmproj(out, text_n_embd=...)` writes a file that
llama-server loads with `--mmproj` next to a synthetic qwen35 text model, so the image path (preprocess,
ViT, merger, M-RoPE positions of the image tokens in the text model) runs on the CPU in tests. Nothing
is downloaded; the weights are random, so the "vision" sees nothing, but every shape and key is the
one the pinned loader checks and the activations stay finite.

What it follows (the pinned llama.cpp, tree 832db069):
- conversion/qwen3vl.py: `Qwen3_5ForConditionalGeneration` (and the MoE variant) is converted by the
  Qwen3-VL vision converter, which writes `clip.projector_type = "qwen3vl_merger"` (PROJECTOR_TYPE_QWEN3VL),
  `clip.use_gelu = true`, `clip.vision.spatial_merge_size`, `clip.vision.attention.layer_norm_epsilon`
  (the text config's rms_norm_eps) and `clip.vision.is_deepstack_layers` (one bool per block); the
  HF Conv3D patch embedding (temporal patch 2) becomes two Conv2D kernels `v.patch_embd.weight` and
  `v.patch_embd.weight.1`; the merger becomes `v.post_ln` (its LayerNorm) and `mm.0` / `mm.2` (its
  linear_fc1 / linear_fc2). conversion/base.py MmprojModel writes general.type "mmproj", the
  clip.vision.* sizes, image_mean / image_std and projection_dim = the text model's hidden size.
- tools/mtmd/clip.cpp load_hparams / load_tensors and clip-impl.h (key and tensor names): required keys
  are clip.vision.{embedding_length, attention.head_count, feed_forward_length, block_count,
  projection_dim, attention.layer_norm_epsilon, image_size, patch_size} and image_mean/std (3 values);
  for QWEN3VL the merge size defaults to 2, image tokens are limited to [8, 4096] (so small images are
  scaled up), `mm.0.{weight,bias}` and `mm.2.{weight,bias}` are required, and each block needs
  `attn_out.weight`, `ffn_up.weight`, `ffn_down.weight`. The embedding size it hands to the text model is
  `mm.2.bias` rows x (1 + deepstack blocks): no deepstack here, because the qwen35 text arch reads no
  deepstack inputs (llama-model.cpp) and mtmd refuses a projector whose output differs from the text
  model's n_embd_inp.
- tools/mtmd/models/qwen3vl.cpp (the graph): the patch bias and the learned position table
  (`v.position_embd.weight`, n_embd x (image_size / patch)^2, a square grid, bilinearly resized to the
  image) are required; attention is one fused `attn_qkv` with bias, M-RoPE over head_dim / 2 with four
  equal sections of head_dim / 4 (so head_dim must be a multiple of 4); LayerNorm (with bias)
  everywhere; the spatial merge of 2x2 patches is hard-wired (n_embd x 4 into the merger).
- tools/mtmd/mtmd.cpp: QWEN3VL images are wrapped in <|vision_start|> ... <|vision_end|> (both in the
  Qwen2.5 donor vocabulary) and the dyn-size preprocessor resizes to a multiple of patch x merge.

The `qwen35-27b` preset is the Qwen3.5 vision tower as third-party configs quote it (Qwen3-VL family
defaults with no deepstack: depth 27, hidden 1152, intermediate 4304, 16 heads, patch 16, spatial merge 2,
2304 position embeddings = a 48 x 48 grid, i.e. image_size 768; e.g. the xtuner Qwen3_5_VisionConfig
with `deepstack_visual_indexes = []`); about 0.46 B parameters, ~0.9 GB in F16.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmem_llama.errors import KvmemError
from kvmem_llama.synth import begin_tensor_data, writing_gguf

PROJECTOR_TYPE = "qwen3vl_merger"  # PROJECTOR_TYPE_QWEN3VL in clip-impl.h
F32, F16 = 0, 1  # ggml type ids
ALIGNMENT = 32  # GGUF default data alignment
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 8, 4096  # clip.cpp's token limits for QWEN3VL (without --image-*-tokens)
MOSTLY_F16 = 1  # general.file_type


@dataclass(frozen=True)
class VisionShape:
    """Everything that decides the tensors and metadata of a synthetic qwen3vl_merger projector."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    patch_size: int = 16
    image_size: int = 256  # the position table covers (image_size / patch_size)^2 patches
    spatial_merge: int = 2  # the graph hard-wires 2x2
    eps: float = 1e-6
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_pos(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def merged_dim(self) -> int:
        return self.n_embd * self.spatial_merge ** 2

    def check(self) -> None:
        if self.spatial_merge != 2:
            raise KvmemError(f"spatial merge {self.spatial_merge}: the pinned qwen3vl graph only merges 2x2")
        if self.n_embd % self.n_head or self.head_dim % 4:
            raise KvmemError(f"head dim {self.n_embd}/{self.n_head} must be a whole multiple of 4 (M-RoPE sections)")
        if self.image_size % (self.patch_size * self.spatial_merge):
            raise KvmemError(f"image size {self.image_size} is not a multiple of patch x merge")

    def image_grid(self, width: int, height: int, min_tokens: int = MIN_IMAGE_TOKENS,
                   max_tokens: int = MAX_IMAGE_TOKENS) -> tuple[int, int]:
        """(width, height) in pixels that the pinned dyn-size preprocessor resizes a WIDTHxHEIGHT image to:
        each side rounded to a multiple of patch x merge, scaled up to min_tokens or down to max_tokens."""
        f = self.patch_size * self.spatial_merge
        area = f * f  # pixels per image token
        min_px, max_px = min_tokens * area, max_tokens * area
        w, h = max(f, round(width / f) * f), max(f, round(height / f) * f)
        if w * h > max_px:
            beta = math.sqrt(width * height / max_px)
            w, h = max(f, math.floor(width / beta / f) * f), max(f, math.floor(height / beta / f) * f)
        elif w * h < min_px:
            beta = math.sqrt(min_px / (width * height))
            w, h = math.ceil(width * beta / f) * f, math.ceil(height * beta / f) * f
        return w, h

    def n_image_tokens(self, width: int, height: int) -> int:
        """Embeddings one WIDTHxHEIGHT image becomes (without the <|vision_start|>/<|vision_end|> tokens)."""
        w, h = self.image_grid(width, height)
        f = self.patch_size * self.spatial_merge
        return (w // f) * (h // f)


PRESETS: dict[str, VisionShape] = {
    # 2 blocks of width 64 (4 heads of 16): ~0.2 M parameters, a few hundred KB; encodes an image in milliseconds
    "tiny": VisionShape(n_layer=2, n_embd=64, n_ff=256, n_head=4, image_size=256),
    # the Qwen3.5 vision tower (see the module docstring for the sources)
    "qwen35-27b": VisionShape(n_layer=27, n_embd=1152, n_ff=4304, n_head=16, image_size=768),
}


@dataclass(frozen=True)
class VisionTensor:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length (fan-in of a matmul weight)
    qtype: int
    init: str  # "normal" | "ones" | "zeros"
    std: float = 0.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.ne) * (2 if self.qtype == F16 else 4)


def make_vision_plan(shape: VisionShape, text_n_embd: int) -> list[VisionTensor]:
    """All tensors of the projector in file order. Linear layers are scaled by 1/sqrt(fan_in) (residual-branch
    outputs also by 1/sqrt(2 n_layer)); LayerNorms are ones and zeros; biases are small."""
    shape.check()
    E, F, L, P = shape.n_embd, shape.n_ff, shape.n_layer, shape.patch_size
    M = shape.merged_dim
    out_std = 1.0 / math.sqrt(2 * L)
    bias_std = 0.02
    t: list[VisionTensor] = []

    def mat(name: str, ne0: int, ne1: int, gain: float = 1.0) -> None:
        t.append(VisionTensor(f"{name}.weight", (ne0, ne1), F16, "normal", gain / math.sqrt(ne0)))
        t.append(VisionTensor(f"{name}.bias", (ne1,), F32, "normal", bias_std))

    def norm(name: str, n: int) -> None:
        t.append(VisionTensor(f"{name}.weight", (n,), F32, "ones"))
        t.append(VisionTensor(f"{name}.bias", (n,), F32, "zeros"))

    # the two temporal halves of the Conv3D patch embedding; a still image feeds both the same pixels
    conv_std = 1.0 / math.sqrt(2 * 3 * P * P)
    t.append(VisionTensor("v.patch_embd.weight", (P, P, 3, E), F32, "normal", conv_std))
    t.append(VisionTensor("v.patch_embd.weight.1", (P, P, 3, E), F32, "normal", conv_std))
    t.append(VisionTensor("v.patch_embd.bias", (E,), F32, "normal", bias_std))
    t.append(VisionTensor("v.position_embd.weight", (E, shape.n_pos), F32, "normal", 0.5))
    for il in range(L):
        p = f"v.blk.{il}"
        norm(f"{p}.ln1", E)
        mat(f"{p}.attn_qkv", E, 3 * E)
        mat(f"{p}.attn_out", E, E, out_std)
        norm(f"{p}.ln2", E)
        mat(f"{p}.ffn_up", E, F)
        mat(f"{p}.ffn_down", F, E, out_std)
    norm("v.post_ln", E)  # the merger's LayerNorm, before the 2x2 merge
    mat("mm.0", M, M)
    mat("mm.2", M, text_n_embd)
    return t


def _metadata(writer, shape: VisionShape, text_n_embd: int, preset: str, seed: int) -> None:
    from gguf import GGUFValueType

    writer.add_string("general.type", "mmproj")
    writer.add_string("general.name", f"kvmem synthetic qwen3vl_merger {preset}")
    writer.add_uint32("general.file_type", MOSTLY_F16)
    writer.add_string("kvmem.synth.preset", preset)
    writer.add_uint32("kvmem.synth.seed", seed)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", PROJECTOR_TYPE)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.projection_dim", text_n_embd)
    writer.add_uint32("clip.vision.image_size", shape.image_size)
    writer.add_uint32("clip.vision.patch_size", shape.patch_size)
    writer.add_uint32("clip.vision.embedding_length", shape.n_embd)
    writer.add_uint32("clip.vision.feed_forward_length", shape.n_ff)
    writer.add_uint32("clip.vision.block_count", shape.n_layer)
    writer.add_uint32("clip.vision.attention.head_count", shape.n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", shape.eps)
    writer.add_uint32("clip.vision.spatial_merge_size", shape.spatial_merge)
    writer.add_key_value("clip.vision.image_mean", list(shape.image_mean), GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.FLOAT32)
    writer.add_key_value("clip.vision.image_std", list(shape.image_std), GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.FLOAT32)
    writer.add_key_value("clip.vision.is_deepstack_layers", [False] * shape.n_layer, GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.BOOL)


def _values(spec: VisionTensor, ss: np.random.SeedSequence) -> np.ndarray:
    n = math.prod(spec.ne)
    if spec.init == "ones":
        values = np.ones(n, dtype=np.float32)
    elif spec.init == "zeros":
        values = np.zeros(n, dtype=np.float32)
    else:
        rng = np.random.Generator(np.random.SFC64(ss))
        values = rng.standard_normal(n, dtype=np.float32) * np.float32(spec.std)
    return values.astype(np.float16) if spec.qtype == F16 else values


def synthesize_mmproj(out: str | Path, *, text_n_embd: int, preset: str = "tiny", seed: int = 0,
                      force: bool = False) -> Path:
    """Write a synthetic qwen3vl_merger projector for a text model of hidden size TEXT_N_EMBD to OUT (via
    OUT.part, renamed when complete). The bytes depend on the preset, text_n_embd and seed only."""
    from gguf import GGMLQuantizationType

    if preset not in PRESETS:
        raise KvmemError(f"unknown vision preset {preset!r}", hint=f"one of: {', '.join(PRESETS)}")
    if text_n_embd < 1:
        raise KvmemError(f"text_n_embd must be positive, not {text_n_embd}")
    out = Path(out)
    if out.exists() and not force:
        raise KvmemError(f"{out} already exists", hint="pass force=True to overwrite it")
    if not out.parent.is_dir():
        raise KvmemError(f"directory {out.parent} does not exist")
    shape = PRESETS[preset]
    plan = make_vision_plan(shape, text_n_embd)
    with writing_gguf(out, "clip") as writer:
        _metadata(writer, shape, text_n_embd, preset, seed)
        fout = begin_tensor_data(writer, [(t.name, t.ne, t.nbytes, GGMLQuantizationType(t.qtype)) for t in plan])
        for spec, ss in zip(plan, np.random.SeedSequence(seed).spawn(len(plan)), strict=True):
            data = _values(spec, ss)
            if data.nbytes != spec.nbytes:  # a plan/generator mismatch would make a silently corrupt file
                raise RuntimeError(f"{spec.name}: {data.nbytes} bytes, expected {spec.nbytes}")
            data.tofile(fout)
            writer.write_padding(fout, data.nbytes)
    return out


def synthetic_png(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB PNG of gradients shifted by seed (encoded with zlib and struct only): an image for the tests and for
    `kvmem bench --image` where no image library is installed."""
    rows = []
    for y in range(height):
        row = bytearray([0])  # filter type 0 for each scanline
        for x in range(width):
            row += bytes(((x * 4 + seed * 37) % 256, (y * 4 + seed * 91) % 256, ((x + y) * 2 + seed * 13) % 256))
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"".join(rows)))
            + chunk(b"IEND", b""))
