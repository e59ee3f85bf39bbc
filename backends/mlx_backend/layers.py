"""Llama/Qwen3 decoder pieces in MLX, the same math as backends/torch_backend/layers.py.

Weights are fused and stored [in, out] as in the torch backend; RoPE tables come from the same
inverse frequencies (including scaled variants), so both backends rotate identically."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from hetero_sd.models.config import ArchConfig

from hetero_sd.models.layout import inv_frequencies, layer_weights


def evaluated(*arrays: mx.array) -> mx.array:
    """The arrays computed now; the first returned. MLX ties an array not yet computed to the thread that made it
    (its stream: computing it on another thread fails), and a model's arrays are made on the thread that loads it
    or runs a job, then used on any lane's thread: what a model keeps between jobs is never left uncomputed."""
    mx.eval(*(a for a in arrays if a is not None))
    return arrays[0]


def to_mx(t, dtype=mx.float32):
    return None if t is None else evaluated(mx.array(t.detach().float().cpu().numpy()).astype(dtype))


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


class Rope:
    def __init__(self, cfg: ArchConfig, dtype):
        inv_freq, self.factor = inv_frequencies(cfg)
        self.inv_freq, self.dtype = inv_freq.numpy(), dtype
        self.cos = self.sin = evaluated(mx.zeros((0, cfg.head_dim)))

    def at(self, start: int, count: int) -> tuple[mx.array, mx.array]:
        if start + count > self.cos.shape[0]:
            n = max(start + count, 2 * self.cos.shape[0], 256)
            freqs = np.outer(np.arange(n, dtype=np.float32), self.inv_freq)
            emb = np.concatenate([freqs, freqs], -1)
            self.cos, self.sin = (evaluated(mx.array(f(emb) * self.factor).astype(self.dtype))
                                  for f in (np.cos, np.sin))
        return self.cos[start:start + count], self.sin[start:start + count]


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class KVCache:
    """Per-layer K/V [1, kv_heads, capacity, head_dim], preallocated in steps of STEP positions and
    written in place, so that a decode step copies only its own tokens (as mlx-lm's cache does);
    crops by moving `length`."""

    STEP = 256

    def __init__(self, cfg: ArchConfig, num_layers: int, dtype):
        self.cfg, self.num_layers, self.dtype = cfg, num_layers, dtype
        self.k: list[mx.array | None] = [None] * num_layers
        self.v: list[mx.array | None] = [None] * num_layers
        self.length = 0

    def empty_like(self) -> "KVCache":
        return KVCache(self.cfg, self.num_layers, self.dtype)

    def write(self, layer: int, start: int, k: mx.array, v: mx.array):
        """Keep positions [0, start), put k/v at [start, start+T); return K/V over [0, start+T)."""
        end = start + k.shape[2]
        if self.k[layer] is None or end > self.k[layer].shape[2]:
            self.grow(layer, start, end, k)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def grow(self, layer: int, keep: int, end: int, like: mx.array) -> None:
        shape = (*like.shape[:2], -(-end // self.STEP) * self.STEP, like.shape[3])
        k, v = mx.zeros(shape, like.dtype), mx.zeros(shape, like.dtype)
        if self.k[layer] is not None and keep > 0:
            k[:, :, :keep] = self.k[layer][:, :, :keep]
            v[:, :, :keep] = self.v[layer][:, :, :keep]
        self.k[layer], self.v[layer] = evaluated(k, v), v


class DecoderLayer:
    """One pre-norm decoder layer (fused q|k|v and gate|up, weights [in, out])."""

    def __init__(self, cfg: ArchConfig, tensors: dict, prefix: str, where, dtype):
        w = layer_weights(tensors, prefix, cfg, where, "cpu", torch.float32)
        self.cfg, self.nq, self.nkv = cfg, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.wqkv = to_mx(torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]).t(), dtype)
        self.bqkv = to_mx(torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]]), dtype) if "q_bias" in w else None
        self.wo, self.w_down = to_mx(w["o_proj"].t(), dtype), to_mx(w["down_proj"].t(), dtype)
        self.w_gate_up = to_mx(torch.cat([w["gate_proj"], w["up_proj"]]).t(), dtype)
        self.in_norm, self.post_norm = to_mx(w["input_layernorm"], dtype), to_mx(w["post_attention_layernorm"], dtype)
        self.q_norm, self.k_norm = to_mx(w.get("q_norm"), dtype), to_mx(w.get("k_norm"), dtype)

    def heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], n, self.cfg.head_dim).transpose(0, 2, 1, 3)

    def project(self, x, cos, sin, queries: bool = True):
        """Normed input [1, T, H] -> (q,) k, v heads with qk-norm and RoPE."""
        c = self.cfg
        w, b = (self.wqkv, self.bqkv) if queries else (self.wqkv[:, self.nq:], None if self.bqkv is None
                                                         else self.bqkv[self.nq:])
        out = x @ w if b is None else x @ w + b
        parts = mx.split(out, [self.nq, self.nq + self.nkv], -1) if queries else mx.split(out, [self.nkv], -1)
        k, v = self.heads(parts[-2], c.num_key_value_heads), self.heads(parts[-1], c.num_key_value_heads)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, c.rms_norm_eps)
        k = apply_rope(k, cos, sin)
        if not queries:
            return k, v
        q = self.heads(parts[0], c.num_attention_heads)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, c.rms_norm_eps)
        return apply_rope(q, cos, sin), k, v

    def attend(self, h, q, keys, values, mask):
        c = self.cfg
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=c.head_dim ** -0.5, mask=mask)
        h = h + o.transpose(0, 2, 1, 3).reshape(h.shape[0], h.shape[1], self.nq) @ self.wo
        gate, up = mx.split(rms_norm(h, self.post_norm, c.rms_norm_eps) @ self.w_gate_up, 2, -1)
        return h + (gate * mx.sigmoid(gate) * up) @ self.w_down
