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

from .cpu import cpu_flags
from .gemm import KernelUnavailable, build
from .layers import linear

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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


#if defined(__x86_64__)
// ---- causal attention, one query row at a time (decode and verify agree bit for bit) ----
// torch's SDPA sums in a different order for one query row than for a block of rows, and int8 rows
// (quant8.py) turn that 1e-6 into different codes. Here each (row, head) is computed alone, in the same
// order whatever the number of rows: scores q.k_j in 8-lane sums reduced in a fixed tree, exp by one
// polynomial, sum and weighted values accumulated over j in order. AVX2 (on AVX-512 CPUs too).
__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// e^x for x <= 0 (Cephes expf: ~1 ulp), 8 lanes
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// q [1, nh, T, D] at positions start..start+T-1; caches [1, nkv, cap, D] -> o [1, T, nh*D]; D = 64 or 128
// 8 keys' partial sums (one vector each) to their 8 scores by one transposing tree: every key is summed
// ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) wherever it sits in its group of 8
__attribute__((target("avx2,fma"))) static inline __m256 reduce8(const __m256* a) {
  __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h4, 0x20), _mm256_permute2f128_ps(h0, h4, 0x31));
}

// scores s[j] = q.k_j * scale, 8 keys at a time (8 independent sums, not one chain of dependent FMAs); the max
template <int D>  // a compile-time head size: q and the accumulators then live in registers
__attribute__((target("avx2,fma"))) static float scores256(const float* q, const float* kc, int64_t n, float scale, float* s) {
  __m256 qv[D / 8];
  for (int d = 0; d < D; d += 8) qv[d / 8] = _mm256_loadu_ps(q + d);
  float mx = -INFINITY;
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) {
      const float* k = kc + std::min(j0 + u, n - 1) * D;  // past the last key: any key (masked later)
      a[u] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
      for (int d = 8; d < D; d += 8) a[u] = _mm256_fmadd_ps(qv[d / 8], _mm256_loadu_ps(k + d), a[u]);
    }
    _mm256_storeu_ps(s + j0, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale)));
    for (int64_t j = j0; j < std::min(j0 + 8, n); ++j) mx = std::max(mx, s[j]);
  }
  return mx;
}

// s[j] <- e^(s[j] - mx), in place, padded to the group of 8 with zeros; their sum
__attribute__((target("avx2,fma"))) static float softmax_weights(float* s, int64_t n, float mx) {
  for (int64_t j = n; j < (n + 7) / 8 * 8; ++j) s[j] = -INFINITY;  // e^-inf = 0
  __m256 sum = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
  for (int64_t j = 0; j < n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum8(sum);
}

// o = inv * sum_j s[j] v_j, accumulated over j in order (each output lane alone: the same on both widths)
template <int D>
__attribute__((target("avx2,fma"))) static void values256(const float* s, const float* vc, int64_t n, float inv, float* o) {
  __m256 acc[D / 8];
  for (int d = 0; d < D; d += 8) acc[d / 8] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(s[j]);
    for (int d = 0; d < D; d += 8) acc[d / 8] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + j * D + d), acc[d / 8]);
  }
  for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(acc[d / 8], _mm256_set1_ps(inv)));
}

template <int D>
static void attend_row(const float* q, const float* kc, const float* vc, int64_t n, float scale, float* s, float* o) {
  // 8 lanes on AVX-512 CPUs too: a 16-lane variant measured within 4% (not FMA-bound: exp and the max)
  const float inv = 1.0f / softmax_weights(s, n, scores256<D>(q, kc, n, scale, s));
  values256<D>(s, vc, n, inv, o);
}

torch::Tensor attend(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, int64_t start) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "attend: contiguous q and caches");
  const int64_t nh = q.size(1), T = q.size(2), D = q.size(3), nkv = kc.size(1), cap = kc.size(2);
  TORCH_CHECK((D == 64 || D == 128) && nh % nkv == 0 && start + T <= cap, "attend: shapes");
  auto o = torch::empty({1, T, nh * D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const float scale = 1.0f / std::sqrt((float)D);
  at::parallel_for(0, T * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(start + T + 16);
    for (int64_t i = begin; i < end; ++i) {
      int64_t t = i / nh, h = i % nh, g = h / (nh / nkv);
      (D == 64 ? attend_row<64> : attend_row<128>)(qp + (h * T + t) * D, kp + g * cap * D, vp + g * cap * D,
                                                   start + t + 1, scale, s.data(), op + t * nh * D + h * D);
    }
  });
  return o;
}
#define HAS_ATTEND true
#else
torch::Tensor attend(torch::Tensor q, torch::Tensor, torch::Tensor, int64_t) { TORCH_CHECK(false, "attend: x86-64 only"); return q; }
#define HAS_ATTEND false
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // kernels release the GIL: the other lane's thread runs meanwhile
  m.def("attend", &attend, py::call_guard<py::gil_scoped_release>());
  m.attr("has_attend") = HAS_ATTEND;
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope_qkv", &rope_qkv, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>());
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
    attend = ext.has_attend and cfg.head_dim in (64, 128) and {"avx2", "fma"} <= cpu_flags()
    x = ext.rms_norm(h, layers[0].in_norm, eps)
    captured = []
    for i, layer in enumerate(layers):
        q, keys, values = ext.rope_qkv(linear(x, layer.mm_qkv), cos, sin, target.cache.k[i],
                                       target.cache.v[i], start, nh, nkv)
        if attend:  # causal, row by row: the same bits alone or in a verify block
            o = ext.attend(q, target.cache.k[i], target.cache.v[i], start)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                                 enable_gqa=nkv != nh).transpose(1, 2)
        h, x = ext.add_rms_norm(h, linear(o.reshape(1, -1, layer.nq), layer.mm_o), layer.post_norm, eps)
        mlp = linear(ext.silu_mul(linear(x, layer.mm_gate_up)), layer.mm_down)
        # the next layer's input norm, or the final norm after the last layer
        h, x = ext.add_rms_norm(h, mlp, layers[i + 1].in_norm if i + 1 < len(layers) else target.norm, eps)
        if features and i in target.layer_ids:
            captured.append(h)
    return x, captured


