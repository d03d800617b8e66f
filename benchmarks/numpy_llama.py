"""A numpy forward pass of a llama- or qwen2-architecture GGUF (SmolLM2-135M, Qwen2.5-Coder): every layer's K/V
kept, and a tail of the prompt recomputed over a chosen subset of the cached positions, optionally with extra
"stand-in" keys and values (benchmarks/fidelity_probe.py). float32 throughout; about a minute for a 4K-token prompt
on two cores (SmolLM2)."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class Llama:
    def __init__(self, path: str) -> None:
        r = GGUFReader(path)

        def field(key: str):
            fld = r.fields[key]
            return fld.parts[fld.data[0]]

        arch = bytes(field("general.architecture")).decode()
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"{path}: architecture {arch!r}; this copy runs llama and qwen2")

        def val(key: str):
            return field(f"{arch}.{key}")[0]

        self.n_layer = int(val("block_count"))
        self.n_embd = int(val("embedding_length"))
        self.n_head = int(val("attention.head_count"))
        self.n_kv = int(val("attention.head_count_kv"))
        self.eps = float(val("attention.layer_norm_rms_epsilon"))
        self.base = float(val("rope.freq_base"))
        self.neox = arch == "qwen2"  # llama.cpp's rope type: NEOX rotates the halves, NORM adjacent pairs
        self.hd = self.n_embd // self.n_head
        # ggml's [ne0, ne1] is numpy's (ne1, ne0): a weight is (n_out, n_in); without an output matrix the embedding
        # is tied to it
        self.w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in r.tensors}
        self.w.setdefault("output.weight", self.w["token_embd.weight"])
        half = self.hd // 2
        self.inv = self.base ** (-np.arange(half, dtype=np.float64) * 2 / self.hd)

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        # x [T, H, hd]; the pairs rotated: NORM (x[2i], x[2i+1]), NEOX (x[i], x[i + hd/2])
        ang = pos[:, None].astype(np.float64) * self.inv[None, :]
        c, s = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        half = self.hd // 2
        first, second = (np.s_[..., :half], np.s_[..., half:]) if self.neox else (np.s_[..., 0::2], np.s_[..., 1::2])
        x0, x1 = x[first], x[second]
        out = np.empty_like(x)
        out[first] = x0 * c - x1 * s
        out[second] = x0 * s + x1 * c
        return out

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def layer_qkv(self, il: int, x: np.ndarray, pos: np.ndarray):
        w = self.w
        h = self.norm(x, w[f"blk.{il}.attn_norm.weight"])
        q, k, v = (self.linear(h, f"blk.{il}.attn_{n}") for n in "qkv")
        q = q.reshape(len(x), self.n_head, self.hd)
        k, v = k.reshape(len(x), self.n_kv, self.hd), v.reshape(len(x), self.n_kv, self.hd)
        return self.rope(q, pos), self.rope(k, pos), v

    def linear(self, h: np.ndarray, name: str) -> np.ndarray:
        bias = self.w.get(f"{name}.bias")  # qwen2's q/k/v have one
        y = h @ self.w[f"{name}.weight"].T
        return y if bias is None else y + bias

    def layer_out(self, il: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        w = self.w
        x = x + attn.reshape(len(x), -1) @ w[f"blk.{il}.attn_output.weight"].T
        h = self.norm(x, w[f"blk.{il}.ffn_norm.weight"])
        g = h @ w[f"blk.{il}.ffn_gate.weight"].T
        u = h @ w[f"blk.{il}.ffn_up.weight"].T
        return x + ((g / (1 + np.exp(-g))) * u) @ w[f"blk.{il}.ffn_down.weight"].T

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.norm(x, self.w["output_norm.weight"]) @ self.w["output.weight"].T

    def attend(self, q, qpos, K, V, kpos, extra=None):
        """q [T, H, hd] at qpos; keys K/V [N, KV, hd] at kpos (causal by position); extra: (Ks [M, KV, hd],
        Vs [M, KV, hd], bias [M]) stand-ins seen by every query."""
        g = self.n_head // self.n_kv
        scale = 1 / np.sqrt(self.hd)
        out = np.empty_like(q)
        for kv in range(self.n_kv):
            qs = q[:, kv * g:(kv + 1) * g, :].transpose(1, 0, 2)  # [g, T, hd]
            s = qs @ K[:, kv, :].T * scale  # [g, T, N]
            s = np.where(kpos[None, None, :] <= qpos[None, :, None], s, -np.inf)
            vals = V[:, kv, :]
            if extra is not None:
                Ks, Vs, bias = extra
                se = qs @ Ks[:, kv, :].T * scale + bias[None, None, :]
                s = np.concatenate([s, se], axis=2)
                vals = np.concatenate([vals, Vs[:, kv, :]], axis=0)
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            p /= p.sum(-1, keepdims=True)
            out[:, kv * g:(kv + 1) * g, :] = (p @ vals).transpose(1, 0, 2)
        return out

    def full(self, tokens: np.ndarray, chunk: int = 512, window: int | None = None, sink: int = 128,
             block: int = 128, queries: list[np.ndarray] | None = None):
        """All tokens, causal: the final hidden states and every layer's K, V. window: each chunk (a ubatch) sees
        only the sink and the newest `window` tokens before it, from a block boundary (a tiered prefill). queries:
        receives every layer's query rows (post-RoPE)."""
        T = len(tokens)
        pos = np.arange(T)
        x = self.w["token_embd.weight"][tokens]
        Ks, Vs = [], []
        for il in range(self.n_layer):
            q, k, v = self.layer_qkv(il, x, pos)
            Ks.append(k)
            Vs.append(v)
            if queries is not None:
                queries.append(q)
            attn = np.empty_like(q)
            for c0 in range(0, T, chunk):
                c1 = min(T, c0 + chunk)
                if window is None:
                    idx = pos[:c1]
                else:
                    w0 = min(c0, max(sink, (c0 - window) // block * block))
                    idx = np.concatenate([pos[:min(sink, w0)], pos[w0:c1]])
                attn[c0:c1] = self.attend(q[c0:c1], pos[c0:c1], k[idx], v[idx], idx)
            x = self.layer_out(il, x, attn)
        return x, Ks, Vs

    def tail(self, tokens: np.ndarray, t0: int, Ks, Vs, keep: np.ndarray, standins=None):
        """Tokens [t0, T) recomputed over the cached K/V of positions `keep` (< t0) plus themselves; standins(il)
        -> (Ks, Vs, bias) or None. Returns the tail's hidden states."""
        pos = np.arange(t0, len(tokens))
        x = self.w["token_embd.weight"][tokens[t0:]]
        for il in range(self.n_layer):
            q, k, v = self.layer_qkv(il, x, pos)
            K = np.concatenate([Ks[il][keep], k])
            V = np.concatenate([Vs[il][keep], v])
            kp = np.concatenate([keep, pos])
            attn = self.attend(q, pos, K, V, kp, standins(il) if standins else None)
            x = self.layer_out(il, x, attn)
        return x
