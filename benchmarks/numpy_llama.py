"""A numpy forward pass of a llama-architecture GGUF (SmolLM2-135M): every layer's K/V kept, and a tail of the
prompt recomputed over a chosen subset of the cached positions, optionally with extra "stand-in" keys and values
(benchmarks/fidelity_probe.py). float32 throughout; about a minute for a 4K-token prompt on two cores."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class Llama:
    def __init__(self, path: str) -> None:
        r = GGUFReader(path)

        def val(key: str):
            fld = r.fields[key]
            return fld.parts[fld.data[0]][0]

        self.n_layer = int(val("llama.block_count"))
        self.n_embd = int(val("llama.embedding_length"))
        self.n_head = int(val("llama.attention.head_count"))
        self.n_kv = int(val("llama.attention.head_count_kv"))
        self.eps = float(val("llama.attention.layer_norm_rms_epsilon"))
        self.base = float(val("llama.rope.freq_base"))
        self.hd = self.n_embd // self.n_head
        # ggml's [ne0, ne1] is numpy's (ne1, ne0): a weight is (n_out, n_in); the output matrix is the tied embedding
        self.w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in r.tensors}
        half = self.hd // 2
        self.inv = self.base ** (-np.arange(half, dtype=np.float64) * 2 / self.hd)

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        # llama.cpp NORM rope: adjacent pairs (x[2i], x[2i+1]); x [T, H, hd]
        ang = pos[:, None].astype(np.float64) * self.inv[None, :]
        c, s = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def layer_qkv(self, il: int, x: np.ndarray, pos: np.ndarray):
        w = self.w
        h = self.norm(x, w[f"blk.{il}.attn_norm.weight"])
        q = (h @ w[f"blk.{il}.attn_q.weight"].T).reshape(len(x), self.n_head, self.hd)
        k = (h @ w[f"blk.{il}.attn_k.weight"].T).reshape(len(x), self.n_kv, self.hd)
        v = (h @ w[f"blk.{il}.attn_v.weight"].T).reshape(len(x), self.n_kv, self.hd)
        return self.rope(q, pos), self.rope(k, pos), v

    def layer_out(self, il: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        w = self.w
        x = x + attn.reshape(len(x), -1) @ w[f"blk.{il}.attn_output.weight"].T
        h = self.norm(x, w[f"blk.{il}.ffn_norm.weight"])
        g = h @ w[f"blk.{il}.ffn_gate.weight"].T
        u = h @ w[f"blk.{il}.ffn_up.weight"].T
        return x + ((g / (1 + np.exp(-g))) * u) @ w[f"blk.{il}.ffn_down.weight"].T

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.norm(x, self.w["output_norm.weight"]) @ self.w["token_embd.weight"].T

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
             block: int = 128):
        """All tokens, causal: the final hidden states and every layer's K, V. window: each chunk (a ubatch) sees
        only the sink and the newest `window` tokens before it, from a block boundary (a tiered prefill)."""
        T = len(tokens)
        pos = np.arange(T)
        x = self.w["token_embd.weight"][tokens]
        Ks, Vs = [], []
        for il in range(self.n_layer):
            q, k, v = self.layer_qkv(il, x, pos)
            Ks.append(k)
            Vs.append(v)
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
