"""Llama/Qwen3 decoder pieces in plain torch, shared by the target and the DFlash draft.

Projections are fused (q|k|v and gate|up) and presented as [in, out] matrices (`x @ W_t`), stored in
whichever memory layout multiplies fastest for their dtype (see `orient`):
- float32: contiguous [in, out]. MKL multiplies a 16-row block by a pre-transposed weight ~4x faster
  than F.linear does with the [out, in] layout (benchmarks/matmul_layout.py, AVX2 EPYC).
- bfloat16 on the CPU: the transposed view of a contiguous [out, in] weight, multiplied as (W @ x^T)^T.
  That operand order reaches oneDNN's AMX/AVX512-BF16 GEMM; x @ W_t and F.linear take slower paths
  (lm_head at 16 rows on a Sapphire Rapids core: 3.8 ms vs 7-12 ms; float32 38 ms). One row is padded to
  two, since a single row falls to a GEMV that is no faster than float32 (benchmarks/README.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_sd.models.config import ArchConfig

from .gemm import KernelUnavailable, Packed
from .quant import Quantized


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 as in HF Llama/Qwen3; result cast back before the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def row_major(device, dtype: torch.dtype) -> bool:
    """Whether weights of this dtype are kept [out, in] in memory (see the module docstring)."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16


def orient(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] weight as the [in, out] matrix `linear` takes, in the layout that is fastest for it."""
    return weight.contiguous().t() if row_major(weight.device, weight.dtype) else weight.t().contiguous()


def linear(x: torch.Tensor, weight_t, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T for W presented as [in, out]: contiguous, the transposed view of a row-major W, or packed
    for the float32 kernel (gemm.Packed, see `multiplier`), or GGUF blocks (quant.Quantized: decode and
    verify rows; longer inputs multiply its float32 fallback)."""
    if isinstance(weight_t, Quantized):
        y = weight_t(x) if weight_t.takes(x) else linear(x, weight_t.fallback)
    elif isinstance(weight_t, Packed):
        y = weight_t(x)
    else:
        y = x @ weight_t if weight_t.stride(-1) == 1 else rows_times(x, weight_t.t())
    return y if bias is None else y + bias


def multiplier(weight_t: torch.Tensor, notes: list[str] | None = None):
    """What `linear` should multiply by: float32 CPU weights packed for the decoding GEMM (gemm.py), when
    its kernel builds on this CPU (otherwise the reason goes to `notes`, once); others as they are."""
    if weight_t.device.type != "cpu" or weight_t.dtype != torch.float32:
        return weight_t
    try:
        return Packed(weight_t)
    except KernelUnavailable as e:
        if notes is not None and not any(n.startswith(KERNEL_NOTE) for n in notes):
            notes.append(f"{KERNEL_NOTE}: {e}; float32 matmuls use torch's (slower for verify-sized blocks)")
        return weight_t


KERNEL_NOTE = "float32 decoding GEMM kernel unavailable"


def rows_times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T computed as (w @ x^T)^T for a contiguous w [out, in]; rows are computed independently
    (identical results for a row alone or in a block), so decode and verify agree exactly."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, flat])  # one row would take the slow GEMV path
    y = (w @ flat.t()).t()[:rows].contiguous()
    return y.view(*x.shape[:-1], w.shape[0])


def inv_frequencies(cfg: ArchConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention factor; scaled variants come from transformers."""
    if cfg.rope_scaling is None:
        exps = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        return (1.0 / cfg.rope_theta ** exps).float(), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    hf_config = AutoConfig.for_model(cfg.model_type, **{k: v for k, v in cfg.raw.items()
                                                      if k not in ("model_type", "auto_map")})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(factor)


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


class KVCache:
    """Per-layer K/V for positions [0, capacity); grows by doubling, crops by moving `length`."""

    def __init__(self, cfg: ArchConfig, num_layers: int, device, dtype, limit: int):
        self.cfg, self.shape = cfg, (1, cfg.num_key_value_heads, 0, cfg.head_dim)
        self.num_layers, self.device, self.dtype, self.limit = num_layers, device, dtype, limit
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.reserve(256)

    def empty_like(self) -> "KVCache":
        return KVCache(self.cfg, self.num_layers, self.device, self.dtype, self.limit)

    def bytes_per_position(self) -> int:
        """K and V of every layer for one position."""
        return 2 * self.num_layers * self.shape[1] * self.shape[3] * self.dtype.itemsize

    def reserve(self, n: int) -> None:
        have = self.k[0].shape[2] if self.k else 0
        if n <= have:
            return
        size = min(max(n, 2 * have), max(n, self.limit))
        shape = self.shape[:2] + (size,) + self.shape[3:]
        new_k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        for old, new in zip(self.k + self.v, new_k + new_v):
            new[:, :, :have] = old
        self.k, self.v = new_k, new_v

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v at positions start.. and return K/V views over [0, start+T)."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class CacheOwner:
    """What the torch target and draft share: a KV cache to crop, a device to wait for."""

    cache: KVCache
    device: str

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)

    def synchronize(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        elif self.device == "mps":
            torch.mps.synchronize()


class DecoderLayer:
    """One pre-norm decoder layer with fused weights (no nn.Module: inference only). The w* tensors are
    the weights as [in, out] matrices (for other consumers: the ANE compiler, floors); the mm_* are what
    the forward multiplies by (see `multiplier`)."""

    def __init__(self, cfg: ArchConfig, w: dict[str, torch.Tensor], notes: list[str] | None = None,
                 pack: bool = True):
        """pack=False: multiply by the [in, out] matrices as they are (training: differentiable, no
        packed copies of weights that change every step)."""
        self.cfg, self.pack = cfg, pack
        self.nq = cfg.num_attention_heads * cfg.head_dim
        self.nkv = cfg.num_key_value_heads * cfg.head_dim
        self.wqkv = orient(torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]))
        self.wkv = self.wqkv[:, self.nq:]  # k|v only, for the draft's context features
        self.bqkv = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]]) if "q_bias" in w else None
        self.bkv = None if self.bqkv is None else self.bqkv[self.nq:]
        self.wo = orient(w["o_proj"])
        self.w_gate_up = orient(torch.cat([w["gate_proj"], w["up_proj"]]))
        self.w_down = orient(w["down_proj"])
        self.in_norm, self.post_norm = w["input_layernorm"], w["post_attention_layernorm"]
        self.q_norm, self.k_norm = w.get("q_norm"), w.get("k_norm")
        self.notes = notes
        self.mm_qkv, self.mm_o = self.multiplier(self.wqkv), self.multiplier(self.wo)
        self.mm_gate_up, self.mm_down = self.multiplier(self.w_gate_up), self.multiplier(self.w_down)
        self._mm_kv = None

    def multiplier(self, weight_t: torch.Tensor):
        return multiplier(weight_t, self.notes) if self.pack else weight_t

    @property
    def mm_kv(self):
        """k|v only (the draft's context features): packed on first use, the target never needs it."""
        if self._mm_kv is None:
            self._mm_kv = self.multiplier(self.wkv)
        return self._mm_kv

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
        h = h + self.attention(q, keys, values, mask)
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


LAYER_TENSORS = {
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
    "input_layernorm": "input_layernorm.weight", "post_attention_layernorm": "post_attention_layernorm.weight",
}


def layer_shapes(cfg: ArchConfig) -> dict[str, tuple]:
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"q_proj": (nq, h), "k_proj": (nkv, h), "v_proj": (nkv, h), "o_proj": (h, nq),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "input_layernorm": (h,), "post_attention_layernorm": (h,),
            "q_norm": (hd,), "k_norm": (hd,), "q_bias": (nq,), "k_bias": (nkv,), "v_bias": (nkv,)}


def layer_weights(tensors, prefix: str, cfg: ArchConfig, where, device, dtype) -> dict[str, torch.Tensor]:
    """Gather and shape-check one layer's tensors (prefix like 'model.layers.3.')."""
    from hetero_sd.models.weights import take

    names = dict(LAYER_TENSORS)
    if cfg.qk_norm:
        names.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    if cfg.attention_bias:
        names.update(q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias",
                     v_bias="self_attn.v_proj.bias")
    shapes = layer_shapes(cfg)
    return {key: take(tensors, prefix + name, shapes[key], where).to(device, dtype)
            for key, name in names.items()}
