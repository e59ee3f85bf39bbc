"""Llama/Qwen3 decoder pieces in plain torch, shared by the target and the DFlash draft.

Projections are fused (q|k|v and gate|up) and presented as [in, out] matrices (`x @ W_t`, matmul.py);
what a layer multiplies by is chosen by the weight plan (plan.py) while the layer is built."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero_sd.backends.base import synchronize
from hetero_sd.backends.policy import DEFAULT, LoadPolicy
from hetero_sd.models.config import ArchConfig
from hetero_sd.models.layout import inv_frequencies, layer_shapes, layer_weights  # noqa: F401  (re-exported)

from .matmul import linear, orient, row_major, rows_times  # noqa: F401  (the layer's matmuls; re-exported)
from .plan import KERNEL_NOTE, plan_matrices


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 as in HF Llama/Qwen3; result cast back before the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def multiplier(weight_t: torch.Tensor, notes: list[str] | None = None, policy: LoadPolicy = DEFAULT):
    """What `linear` should multiply a matrix without GGUF blocks by: WeightPlan.dense for one matrix (the
    reason the GEMM kernel is not used goes to `notes`, once)."""
    plan = plan_matrices(str(weight_t.device), weight_t.dtype, policy)
    made = plan.dense(weight_t)
    if notes is not None and not any(n.startswith(KERNEL_NOTE) for n in notes):
        notes += plan.notes
    return made


class Rope:
    """cos/sin tables for absolute positions, grown on demand."""

    def __init__(self, cfg: ArchConfig, device, dtype):
        self.inv_freq, self.factor = inv_frequencies(cfg)
        self.device, self.dtype = device, dtype
        self.cos = self.sin = torch.empty(0)

    def at(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + count > self.cos.shape[0]:
            n = max(start + count, 2 * self.cos.shape[0], 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
            emb = torch.cat([freqs, freqs], -1)
            self.cos = (emb.cos() * self.factor).to(self.device, self.dtype)
            self.sin = (emb.sin() * self.factor).to(self.device, self.dtype)
        return self.cos[start:start + count], self.sin[start:start + count]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def k_layout(head_dim: int, dtype: torch.dtype, k_q8: bool) -> tuple[int, torch.dtype]:
    """(a K row's width, its dtype): `dtype` rows of head_dim, or with k_q8 the q8_0 blocks of the fused C++
    attention (kernels/attend_q8.h: head_dim codes and head_dim/32 float scales as bytes, tiled by 16 positions)."""
    return (head_dim + head_dim // 8, torch.uint8) if k_q8 else (head_dim, dtype)


FIRST = 256  # positions a cache starts with where it is not allocated whole


def first_allocation(device, limit: int, bytes_per_position: int, free_bytes=None) -> int:
    """Positions a new cache allocates: on a CUDA device the whole `limit` where its K/V take at most a quarter of
    the free memory (the captured steps read the cache where it lies: each time it grows they are captured again),
    else FIRST, grown by doubling as the context needs (a CPU's memory is the model's too)."""
    if torch.device(device).type != "cuda":
        return FIRST
    free = torch.cuda.mem_get_info(torch.device(device))[0] if free_bytes is None else free_bytes
    return max(limit, FIRST) if limit * bytes_per_position <= free // 4 else FIRST


class KVCache:
    """Per-layer K/V for positions [0, capacity); grows by doubling, crops by moving `length`. k_q8: K as q8_0
    blocks (k_layout; only the fused C++ ops write and read it), V in `dtype`."""

    def __init__(self, cfg: ArchConfig, num_layers: int, device, dtype, limit: int, k_q8: bool = False):
        self.cfg, self.shape = cfg, (1, cfg.num_key_value_heads, 0, cfg.head_dim)
        self.num_layers, self.device, self.dtype, self.limit = num_layers, device, dtype, limit
        self.k_q8 = k_q8
        self.k_width, self.k_dtype = k_layout(cfg.head_dim, dtype, k_q8)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.reserve(first_allocation(device, limit, self.bytes_per_position()))

    def empty_like(self) -> "KVCache":
        return KVCache(self.cfg, self.num_layers, self.device, self.dtype, self.limit, self.k_q8)

    def bytes_per_position(self) -> int:
        """K and V of every layer for one position."""
        per_head = self.k_width * self.k_dtype.itemsize + self.shape[3] * self.dtype.itemsize
        return self.num_layers * self.shape[1] * per_head

    def reserve(self, n: int) -> None:
        have = self.k[0].shape[2] if self.k else 0
        if n <= have:
            return
        size = min(max(n, 2 * have), max(n, self.limit))
        size = -(-size // 16) * 16  # whole tiles of 16 positions (the fused attention's tiled K); copied whole below
        shape = self.shape[:2] + (size,) + self.shape[3:]
        # plain tensors whether or not a step grows the cache under inference mode: the compiled steps' guards hold
        # a cache's dispatch keys, and an inference tensor's differ (every growth would compile them again)
        with torch.inference_mode(False):
            new_k = [torch.zeros(shape[:3] + (self.k_width,), device=self.device, dtype=self.k_dtype)
                     for _ in range(self.num_layers)]
            new_v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
            for old, new in zip(self.k + self.v, new_k + new_v):
                new[:, :, :have] = old
        self.k, self.v = new_k, new_v

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v at positions start.. and return K/V views over [0, start+T)."""
        if self.k_q8:
            raise ValueError("a q8_0 K cache is written by the fused C++ ops only (rope), not torch's")
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class TorchOps:
    """The layer's steps in torch ops (any device and dtype): the strategy a target takes unless its weight
    plan says `fused` (fused.FusedLayerOps, the same steps in C++)."""

    needs_mask = True  # SDPA takes the verify rows' causal mask

    def __init__(self, eps: float):
        self.eps = eps

    def norm(self, h, w):
        return rms_norm(h, w, self.eps)

    def add_norm(self, h, d, w):
        """(h + d, its norm): the residual add, and the next sublayer's (or the final) norm."""
        h = h + d
        return h, rms_norm(h, w, self.eps)

    def attention(self, layer: "DecoderLayer", x, cache: "KVCache", i: int, start: int, cos, sin, mask):
        """q|k|v, norms and RoPE, the cache write, attention and o_proj on the normed input x."""
        q, k, v = layer.project_qkv(x, cos, sin)
        keys, values = cache.write(i, start, k, v)
        return layer.attention(q, keys, values, mask)

    def mlp(self, layer: "DecoderLayer", x):
        return layer.mlp(x)

    def layers(self, walk, h, first_norm, cache: "KVCache", start: int, cos, sin, capture) -> tuple | None:
        """The whole walk in one native call, where a strategy has one (fused.FusedLayerOps); None: walk here."""
        return None


def layer_walk(layers, final_norm) -> tuple:
    """(layer, its post-attention norm, the next layer's input norm or `final_norm`) per layer: what
    `through_layers` walks."""
    following = [layer.in_norm for layer in layers[1:]] + [final_norm]
    return tuple((layer, layer.post_norm, norm) for layer, norm in zip(layers, following))


def through_layers(ops, walk, h, first_norm, cache: KVCache, start: int, cos, sin, mask, capture=()) -> tuple:
    """Rows h [1, T, H] through the layers of `walk` ((layer, its post-attention norm, the next layer's input
    norm or the final norm) each) with the ops strategy, their K/V written to `cache` at start..: (the rows
    after the final norm, the residual stream after each layer in `capture`). The target's forward, and a
    CPU draft's block on the fused ops."""
    native = ops.layers(walk, h, first_norm, cache, start, cos, sin, capture)
    if native is not None:
        return native
    captured = []
    x = ops.norm(h, first_norm)
    whole = getattr(ops, "layer", None)  # a strategy's layer in one call (steps.CompiledOps: compiled)
    for i, (layer, post_norm, next_norm) in enumerate(walk):
        if whole is not None:
            h, x = whole(layer, post_norm, next_norm, h, x, cache, i, start, cos, sin, mask)
        else:
            h, x = ops.add_norm(h, ops.attention(layer, x, cache, i, start, cos, sin, mask), post_norm)
            h, x = ops.add_norm(h, ops.mlp(layer, x), next_norm)
        if i in capture:
            captured.append(h)
    return x, captured


class CacheOwner:
    """What the torch target and draft share: a KV cache to crop, a device to wait for."""

    cache: KVCache
    device: str

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)

    def synchronize(self) -> None:
        synchronize(self.device)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer with fused weights, as an nn.Module: its weights are registered buffers,
    the [in, out] matrices (wqkv, bqkv, wo, w_gate_up, w_down: also read by the ANE compiler and the floors)
    and the norms; the mm_* are what the forward multiplies by, chosen by the owner's weight plan while
    the layer is built and never replaced (see `multiplier`). The same module serves the target, the
    draft (inference and, built over its trained parameters, training) and data generation."""

    def __init__(self, cfg: ArchConfig, w: dict[str, torch.Tensor], multiply=None, *, pack: bool = False,
                 kv: bool = False):
        """multiply(name, weight_t): what the forward multiplies by ('mm_qkv', 'mm_o', 'mm_gate_up',
        'mm_down', 'mm_kv'), chosen by the owner's weight plan; None: the [in, out] matrices as they are
        (training: differentiable, no packed copies of weights that change every step), or with pack=True
        (the older signature) packed as `multiplier` does. kv=True: also mm_kv, the k|v columns alone
        (a draft's context features; a target never needs them)."""
        super().__init__()
        if multiply is None and pack:
            multiply = lambda name, weight_t: multiplier(weight_t)  # noqa: E731
        multiply = multiply or (lambda name, weight_t: weight_t)
        self.cfg = cfg
        self.nq = cfg.num_attention_heads * cfg.head_dim
        self.nkv = cfg.num_key_value_heads * cfg.head_dim
        weights = {"wqkv": orient(torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])),
                   "bqkv": torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]]) if "q_bias" in w else None,
                   "wo": orient(w["o_proj"]), "w_gate_up": orient(torch.cat([w["gate_proj"], w["up_proj"]])),
                   "w_down": orient(w["down_proj"]), "in_norm": w["input_layernorm"],
                   "post_norm": w["post_attention_layernorm"], "q_norm": w.get("q_norm"), "k_norm": w.get("k_norm")}
        for name, t in weights.items():
            self.register_buffer(name, t)
        # plain attributes (not buffers): set once here, read on every step without nn.Module's lookup
        self.mm_qkv, self.mm_o = multiply("mm_qkv", self.wqkv), multiply("mm_o", self.wo)
        self.mm_gate_up, self.mm_down = multiply("mm_gate_up", self.w_gate_up), multiply("mm_down", self.w_down)
        self.mm_kv = multiply("mm_kv", self.wkv) if kv else None

    @property
    def wkv(self) -> torch.Tensor:
        """The k|v columns of wqkv (a view): what the draft's context features are multiplied by."""
        return self.wqkv[:, self.nq:]

    @property
    def bkv(self) -> torch.Tensor | None:
        return None if self.bqkv is None else self.bqkv[self.nq:]

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.cfg.head_dim).transpose(1, 2)

    def project_qkv(self, x, cos, sin):
        """x: normed input [1, T, H] -> q [1, nh, T, hd], k/v [1, nkv, T, hd] with norms and RoPE."""
        q, k, v = linear(x, self.mm_qkv, self.bqkv).split([self.nq, self.nkv, self.nkv], -1)
        return self.finish_q(q, cos, sin), self.finish_k(k, cos, sin), self.heads(v, self.cfg.num_key_value_heads)

    def project_kv(self, x, cos, sin):
        k, v = linear(x, self.mm_kv, self.bkv).split([self.nkv, self.nkv], -1)
        return self.finish_k(k, cos, sin), self.heads(v, self.cfg.num_key_value_heads)

    def finish_q(self, q, cos, sin):
        q = self.heads(q, self.cfg.num_attention_heads)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.cfg.rms_norm_eps)
        return apply_rope(q, cos, sin)

    def finish_k(self, k, cos, sin):
        k = self.heads(k, self.cfg.num_key_value_heads)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, self.cfg.rms_norm_eps)
        return apply_rope(k, cos, sin)

    def attend(self, h, q, keys, values, mask):
        """Attention output projected and added to the residual, then the MLP half of the layer."""
        return self.finish(h, self.attention(q, keys, values, mask))

    def finish(self, h, attended):
        """The attention's projected output added to the residual, then the MLP half of the layer."""
        h = h + attended
        return h + self.mlp(rms_norm(h, self.post_norm, self.cfg.rms_norm_eps))

    def attention(self, q, keys, values, mask):
        """Attention over the keys, through o_proj (not yet added to the residual)."""
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                           enable_gqa=keys.shape[1] != q.shape[1])
        return linear(o.transpose(1, 2).reshape(q.shape[0], q.shape[2], self.nq), self.mm_o)

    def mlp(self, x):
        """SwiGLU on the normed input."""
        gate, up = linear(x, self.mm_gate_up).chunk(2, -1)
        return linear(F.silu(gate) * up, self.mm_down)
