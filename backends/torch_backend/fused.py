"""The target's layer as ~12 calls instead of ~50: RMSNorm (with the residual add before it), RoPE on q and
k with the K/V cache write, and SwiGLU's silu(gate) * up, each one C++ loop.

Why: once the decode step's matrices are 4-bit GGUF blocks (quant.py), its weights take ~5 ms to read on
this project's CPU, and the ~1,500 small torch ops of 30 layers took as long again (torch.profiler,
benchmarks/README.md): each op costs a few microseconds of dispatch whatever its size. The matrices, the
attention (SDPA) and everything else stay where they are.

Numerics: the same float32 formulas as layers.py (HF Llama's RMSNorm: x * rsqrt(mean(x^2) + eps), then
times the weight; RoPE x*cos + rotate_half(x)*sin; silu(g) = g / (1 + exp(-g))), summed in a fixed order
per row: a row's result is the same alone or in any block of rows (decode and verify agree bit for bit,
which lossless decoding rests on), and within the parity tests' tolerance of torch's own ops.
Used for float32 CPU targets without q/k norms or biases (Llama-style: the embedded default);
HETERO_SD_FUSED=off opts out, and a kernel that does not build is announced."""

from __future__ import annotations

import functools
import os

import torch

from .gemm import KernelUnavailable, build
from .layers import linear

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstring>

// y = w * (x * 1/sqrt(mean(x^2) + eps)) for one row of H floats (sum in double: order fixed, accurate)
static inline void norm_row(const float* x, const float* w, double eps, int64_t H, float* y) {
  double s = 0.0;
  for (int64_t i = 0; i < H; ++i) s += (double)x[i] * (double)x[i];
  const float r = (float)(1.0 / std::sqrt(s / (double)H + eps));
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t H = xc.size(-1), T = xc.numel() / H;
  const float *xp = xc.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) norm_row(xp + t * H, wp, eps, H, yp + t * H);
  return y;
}

// (h + d, rms_norm(h + d)): the residual add and the next norm in one pass
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor w, double eps) {
  auto hc = h.contiguous(), dc = d.contiguous();
  auto s = torch::empty_like(hc), y = torch::empty_like(hc);
  const int64_t H = hc.size(-1), T = hc.numel() / H;
  const float *hp = hc.data_ptr<float>(), *dp = dc.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  for (int64_t i = 0; i < T * H; ++i) sp[i] = hp[i] + dp[i];
  for (int64_t t = 0; t < T; ++t) norm_row(sp + t * H, wp, eps, H, yp + t * H);
  return {s, y};
}

// one head row: out = x*cos + rotate_half(x)*sin (rotate_half(x) = [-x2, x1])
static inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * c[i], b = -x[i + half] * s[i];
    out[i] = a + b;
  }
  for (int64_t i = half; i < D; ++i) {
    const float a = x[i] * c[i], b = x[i - half] * s[i];
    out[i] = a + b;
  }
}

// qkv [1, T, (nh + 2 nkv) * D] -> q [1, nh, T, D] with RoPE; k (with RoPE) and v written to the caches
// [1, nkv, capacity, D] at positions start..start+T-1. Returns q and the caches' views over [0, start+T).
std::vector<torch::Tensor> rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                                    torch::Tensor vc, int64_t start, int64_t nh, int64_t nkv) {
  auto x = qkv.contiguous();
  auto cs = cos.contiguous(), sn = sin.contiguous();
  const int64_t T = x.size(1), D = cs.size(-1), W = (nh + 2 * nkv) * D, cap = kc.size(2);
  auto q = torch::empty({1, nh, T, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xp + t * W;
    const float *c = cp + t * D, *s = sp + t * D;
    for (int64_t h = 0; h < nh; ++h) rope_row(row + h * D, c, s, D, qp + (h * T + t) * D);
    for (int64_t h = 0; h < nkv; ++h) {
      rope_row(row + (nh + h) * D, c, s, D, kp + (h * cap + start + t) * D);
      std::memcpy(vp + (h * cap + start + t) * D, row + (nh + nkv + h) * D, D * sizeof(float));
    }
  }
  return {q, kc.narrow(2, 0, start + T), vc.narrow(2, 0, start + T)};
}

// [.., 2I] (gate | up) -> [.., I]: silu(gate) * up
torch::Tensor silu_mul(torch::Tensor gu) {
  auto x = gu.contiguous();
  const int64_t I2 = x.size(-1), I = I2 / 2, T = x.numel() / I2;
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float g = xp[t * I2 + i];
      yp[t * I + i] = (g / (1.0f + std::exp(-g))) * xp[t * I2 + I + i];
    }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_qkv", &rope_qkv);
  m.def("silu_mul", &silu_mul);
}
"""


def enabled() -> bool:
    return os.environ.get("HETERO_SD_FUSED", "on").lower() not in ("off", "0", "no", "false")


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled module; KernelUnavailable with the reason (announced by the caller)."""
    return build("hetero_sd_fused", SOURCE)


def fusable(target) -> tuple[bool, str | None]:
    """(whether this target's layers take the fused path, the reason to announce when a float32 CPU target
    does not: other devices and dtypes, and the user's own opt-out, need no note)."""
    if not enabled() or target.device != "cpu" or target.dtype != torch.float32:
        return False, None
    layer = target.layers[0]
    if layer.q_norm is not None or layer.bqkv is not None:
        return False, "fused layer ops not used: q/k norms or biases (Qwen-style layers) are not fused yet"
    try:
        extension()
    except KernelUnavailable as e:
        return False, f"fused layer ops not used: their kernel did not build ({e})"
    return True, None


def forward_layers(target, h: torch.Tensor, start: int, cos, sin, mask, features: bool) -> tuple:
    """The decoder layers on embedded tokens h [1, T, H] at positions start..: (the final norm of the last
    hidden state [1, T, H], the hidden states captured at the target's feature layers)."""
    ext, cfg, eps = extension(), target.config, target.config.rms_norm_eps
    nh, nkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, target.layers
    x = ext.rms_norm(h, layers[0].in_norm, eps)
    captured = []
    for i, layer in enumerate(layers):
        q, keys, values = ext.rope_qkv(linear(x, layer.mm_qkv), cos, sin, target.cache.k[i],
                                       target.cache.v[i], start, nh, nkv)
        o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=nkv != nh)
        h, x = ext.add_rms_norm(h, linear(o.transpose(1, 2).reshape(1, -1, layer.nq), layer.mm_o),
                                layer.post_norm, eps)
        mlp = linear(ext.silu_mul(linear(x, layer.mm_gate_up)), layer.mm_down)
        # the next layer's input norm, or the final norm after the last layer
        h, x = ext.add_rms_norm(h, mlp, layers[i + 1].in_norm if i + 1 < len(layers) else target.norm, eps)
        if features and i in target.layer_ids:
            captured.append(h)
    return x, captured


