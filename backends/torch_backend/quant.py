"""x @ W^T with W kept as GGUF Q4_1 / Q8_0 blocks: the decode and verify steps of a target that came from
a GGUF read ~5.6x fewer bytes per token than its float32 copy, for the same function up to float32 rounding.

Why it is the same function: the converted float32 target (hetero_sd/default_model.py) holds exactly the
dequantized values, d*q + m (Q4_1) and d*q (Q8_0), computed in float32 (`Quantized` checks at load that
the blocks dequantize bitwise to the float32 weights they stand for, and refuses otherwise). Per block of
32 inputs the kernel computes x . (d*q + m) regrouped as d * (x . (q - 8)) + (m + 8d) * sum(x): the same
d, q and m, no weight dequantized (that saves 2 of 9 vector ops per 32 weights, and a decode step is bound
by those ops, not by memory: benchmarks/README.md). Centred on q = 8 because a Q4_1 block's m is about -8d:
d * (x . q) and m * sum(x) then cancel, and their rounding showed in the parity test against float64
(2-3e-4 over its tolerance; centred, within it). Only float32 rounding differs from torch's matmul of the
dequantized weights, within what the parity tests' 1e-4 allows.

Layout (packed once at load): output columns in tiles of NB (AVX-512: 16, one zmm; AVX2: 8, one ymm); per
tile, per block of 32 inputs, NB fp16 scales (and NB fp16 mins for Q4_1) then the block's bytes transposed
so that one load gives byte p of NB rows (Q4_1: 16 bytes of nibble pairs; Q8_0: 32 int8). Each tile is a
contiguous stream, one lane per output column: no horizontal sums. R rows of x (AVX-512: up to 8; AVX2: 4)
share each loaded vector. Every output lane is summed in the same order whatever M is (per block two
float32 chains, low/high nibble or even/odd input, added at the end of the block), and AVX2 performs the
same per-lane operations as AVX-512: a row gives bitwise the same result alone, in any block of rows, on
either ISA.

Parallel over tiles with at::parallel_for (OpenMP). M = 1..MAX_ROWS rows; longer (prefill) goes to the
float32 fallback. Built once per Python environment like gemm.py."""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from .cpu import cpu_flags
from .gemm import KernelUnavailable, build

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <vector>
#include <c10/util/Half.h>

// Per block of 32 inputs and per output lane: S = sum_i x_i q_i (Q4_1: q_i - 8; two chains: low nibbles /
// even inputs, high nibbles / odd inputs, added at the end of the block), then y += d*S (+ (m + 8d)*X for
// Q4_1, X = the block's sum of x, taken once per row): x . (d*q + m) regrouped (see the module's doc).
// Every lane takes the same operations in the same order whatever the number of rows and on either ISA.

// ---- AVX-512: NB = 16 output columns per tile, one zmm per row and accumulator ----
template <int R>
__attribute__((target("avx512f"))) static void q41_512(const float* x, int64_t ldx, const float* xs, int64_t ldxs,
                                                        const uint8_t* w, int64_t KB, float* y, int64_t ldy) {
  constexpr int NB = 16, BB = 20 * NB;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // the nibble -> float conversion is one lookup: vpermps reads only an index's low 4 bits, so it takes
  // the byte as it is for the low nibble (no mask), and the same floats as cvtdq2ps would give
  const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = w + b * BB;
    for (int l = 0; l < BB; l += 64) _mm_prefetch((const char*)(blk + 12 * BB + l), _MM_HINT_T0);
    const uint8_t* qs = blk + 4 * NB;
    const float* xb = x + b * 32;
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) { lo[r] = _mm512_setzero_ps(); hi[r] = _mm512_setzero_ps(); }
    for (int p = 0; p < 16; ++p) {
      __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qs + p * NB)));
      const __m512 ql = _mm512_permutexvar_ps(q, values), qh = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + p]), ql, lo[r]);
        hi[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + p + 16]), qh, hi[r]);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    const __m512 m = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 2 * NB))));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(d, _mm512_add_ps(lo[r], hi[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * ldxs + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <int R>
__attribute__((target("avx512f"))) static void q80_512(const float* x, int64_t ldx, const float*, int64_t,
                                                        const uint8_t* w, int64_t KB, float* y, int64_t ldy) {
  constexpr int NB = 16, BB = 34 * NB;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = w + b * BB;
    for (int l = 0; l < BB; l += 64) _mm_prefetch((const char*)(blk + 16 * BB + l), _MM_HINT_T0);
    const int8_t* qs = (const int8_t*)(blk + 2 * NB);
    const float* xb = x + b * 32;
    __m512 ev[R], od[R];
    for (int r = 0; r < R; ++r) { ev[r] = _mm512_setzero_ps(); od[r] = _mm512_setzero_ps(); }
    for (int k = 0; k < 32; k += 2) {
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + k * NB))));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + (k + 1) * NB))));
      for (int r = 0; r < R; ++r) {
        ev[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k]), w0, ev[r]);
        od[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k + 1]), w1, od[r]);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(d, _mm512_add_ps(ev[r], od[r]), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// ---- AVX2 + FMA + F16C: NB = 8, the same per-lane operations ----
template <int R>
__attribute__((target("avx2,fma,f16c"))) static void q41_256(const float* x, int64_t ldx, const float* xs, int64_t ldxs,
                                                              const uint8_t* w, int64_t KB, float* y, int64_t ldy) {
  constexpr int NB = 8, BB = 20 * NB;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = w + b * BB;
    for (int l = 0; l < BB; l += 64) _mm_prefetch((const char*)(blk + 12 * BB + l), _MM_HINT_T0);
    const uint8_t* qs = blk + 4 * NB;
    const float* xb = x + b * 32;
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); }
    for (int p = 0; p < 16; ++p) {
      __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qs + p * NB)));
      const __m256 ql = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, mask), eight));
      const __m256 qh = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight));
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + p]), ql, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + p + 16]), qh, hi[r]);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    const __m256 m = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 2 * NB))));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(lo[r], hi[r]), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * ldxs + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

template <int R>
__attribute__((target("avx2,fma,f16c"))) static void q80_256(const float* x, int64_t ldx, const float*, int64_t,
                                                              const uint8_t* w, int64_t KB, float* y, int64_t ldy) {
  constexpr int NB = 8, BB = 34 * NB;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = w + b * BB;
    for (int l = 0; l < BB; l += 64) _mm_prefetch((const char*)(blk + 16 * BB + l), _MM_HINT_T0);
    const int8_t* qs = (const int8_t*)(blk + 2 * NB);
    const float* xb = x + b * 32;
    __m256 ev[R], od[R];
    for (int r = 0; r < R; ++r) { ev[r] = _mm256_setzero_ps(); od[r] = _mm256_setzero_ps(); }
    for (int k = 0; k < 32; k += 2) {
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qs + k * NB))));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qs + (k + 1) * NB))));
      for (int r = 0; r < R; ++r) {
        ev[r] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + k]), w0, ev[r]);
        od[r] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + k + 1]), w1, od[r]);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(ev[r], od[r]), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, float*, int64_t);

static Tile pick(bool q41, bool avx512, int r) {
  if (avx512) {
    if (q41) switch (r) { case 1: return q41_512<1>; case 2: return q41_512<2>; case 3: return q41_512<3>; case 4: return q41_512<4>;
                          case 5: return q41_512<5>; case 6: return q41_512<6>; case 7: return q41_512<7>; default: return q41_512<8>; }
    switch (r) { case 1: return q80_512<1>; case 2: return q80_512<2>; case 3: return q80_512<3>; case 4: return q80_512<4>;
                 case 5: return q80_512<5>; case 6: return q80_512<6>; case 7: return q80_512<7>; default: return q80_512<8>; }
  }
  if (q41) switch (r) { case 1: return q41_256<1>; case 2: return q41_256<2>; case 3: return q41_256<3>; default: return q41_256<4>; }
  switch (r) { case 1: return q80_256<1>; case 2: return q80_256<2>; case 3: return q80_256<3>; default: return q80_256<4>; }
}

// the sum of each run of 32 floats, by one fixed tree (the same on every row and either ISA)
__attribute__((target("avx2"))) static void block_sums(const float* x, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * 32;
    __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[b] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
}

// x [..., K] float32 (made contiguous here); packed [tiles][K/32][bytes per block of NB columns] uint8 ->
// y [..., n]: the shapes are handled here, not in Python (a decode step makes 121 of these calls, and each
// Python reshape or slice around them cost about a microsecond)
torch::Tensor qgemm(torch::Tensor x_in, torch::Tensor packed, bool q41, bool avx512, int64_t n) {
  auto x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() >= 1, "qgemm: float32 rows");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kByte && packed.dim() == 3, "qgemm: packed blocks");
  int64_t K = x.size(-1), M = x.numel() / K, tiles = packed.size(0), KB = packed.size(1), bytes = packed.size(2);
  int64_t nb = avx512 ? 16 : 8;
  TORCH_CHECK(KB * 32 == K && bytes == (q41 ? 20 : 34) * nb && n <= tiles * nb && n > (tiles - 1) * nb,
              "qgemm: packed weight does not fit x or this ISA");
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>(); const uint8_t* wp = packed.data_ptr<uint8_t>(); float* yp = y.data_ptr<float>();
  std::vector<float> sums(q41 ? M * KB : 1);  // X: each row's sum over each block (Q4_1's m*X)
  if (q41) block_sums(xp, M * KB, sums.data());
  int64_t rows_max = avx512 ? 8 : 4, stride = KB * bytes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float part[8 * 16];  // a last tile wider than what is left of y: through here
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r0 = 0; r0 < M; r0 += rows_max) {
        int r = (int)std::min(rows_max, M - r0);
        const float* xs = sums.data() + (q41 ? r0 * KB : 0);
        if ((t + 1) * nb <= n) {
          pick(q41, avx512, r)(xp + r0 * K, K, xs, KB, wp + t * stride, KB, yp + r0 * n + t * nb, n);
        } else {
          pick(q41, avx512, r)(xp + r0 * K, K, xs, KB, wp + t * stride, KB, part, nb);
          for (int i = 0; i < r; ++i) std::memcpy(yp + (r0 + i) * n + t * nb, part + i * nb, (n - t * nb) * sizeof(float));
        }
      }
  });
  return y;
}

// GGUF rows [N][K/32 blocks of bb bytes] -> [tiles][K/32][NB scales (, NB mins) fp16, block bytes x NB]:
// the block's bytes in groups of `group` per column (1: byte p of NB columns in one load, this kernel's;
// 4: one 32-bit lane of 4 bytes per column, quant8's integer dot products); flip128: Q8_0 bytes + 128
// (unsigned for vpdpbusd; a padding column then holds code 0 too)
torch::Tensor pack(torch::Tensor rows, bool q41, int64_t nb, int64_t group, bool flip128) {
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == torch::kByte && rows.dim() == 2, "pack: GGUF rows");
  int64_t bb = q41 ? 20 : 34, head = q41 ? 4 : 2, N = rows.size(0), KB = rows.size(1) / bb, tiles = (N + nb - 1) / nb;
  TORCH_CHECK(KB * bb == rows.size(1) && (bb - head) % group == 0, "pack: rows are not whole blocks");
  const uint8_t flip = flip128 && !q41 ? 0x80 : 0;
  auto out = torch::zeros({tiles, KB, bb * nb}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>(); uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < KB; ++b) {
        uint8_t* o = dst + (t * KB + b) * bb * nb;
        for (int64_t j = 0; j < nb; ++j) {
          const bool real = t * nb + j < N;
          const uint8_t* blk = src + (t * nb + j) * KB * bb + b * bb;
          for (int64_t h = 0; h < head; ++h) o[h / 2 * 2 * nb + 2 * j + h % 2] = real ? blk[h] : 0;
          for (int64_t p = 0; p < bb - head; ++p)
            o[head * nb + (p / group) * nb * group + j * group + p % group] = (real ? blk[head + p] : 0) ^ flip;
        }
      }
  });
  return out;
}

// Whether the GGUF rows dequantize (d*q + m, d*q: float32, as gguf-py and so the converter compute them)
// bitwise to w_t [K, N] (the float32 weight as x @ w_t takes it).
bool matches(torch::Tensor rows, bool q41, torch::Tensor w_t) {
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == torch::kByte && w_t.scalar_type() == torch::kFloat, "matches: types");
  int64_t bb = q41 ? 20 : 34, N = rows.size(0), KB = rows.size(1) / bb;
  if (w_t.dim() != 2 || w_t.size(0) != KB * 32 || w_t.size(1) != N) return false;
  const uint8_t* src = rows.data_ptr<uint8_t>(); const float* w = w_t.data_ptr<float>();
  int64_t s0 = w_t.stride(0), s1 = w_t.stride(1);
  std::atomic<bool> ok{true};
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end && ok; ++n)
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* blk = src + n * KB * bb + b * bb;
        float d = (float)*(const c10::Half*)blk;
        for (int i = 0; i < 32; ++i) {
          float v;
          if (q41) {
            float m = (float)*(const c10::Half*)(blk + 2);
            int q = i < 16 ? (blk[4 + i] & 15) : (blk[4 + i - 16] >> 4);
            volatile float dq = d * (float)q;  // two roundings like numpy's (d * q) + m (the first is exact anyway)
            v = dq + m;
          } else {
            v = d * (float)(int8_t)blk[2 + i];
          }
          float have = w[(b * 32 + i) * s0 + n * s1];
          if (std::memcmp(&v, &have, 4) != 0) { ok = false; return; }
        }
      }
  });
  return ok;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // kernels release the GIL: the other lane's thread runs meanwhile
  m.def("qgemm", &qgemm, py::call_guard<py::gil_scoped_release>());  // (x, packed, q41, avx512, n)
  m.def("pack", &pack);
  m.def("matches", &matches);
}
"""

MAX_ROWS = 64  # decode (1), verify (2..16), the draft's head; longer (prefill) multiplies the float32 weights
Q4_1, Q8_0 = "Q4_1", "Q8_0"
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


def isa() -> str | None:
    """'avx512', 'avx2' (with FMA and F16C), or None. HETERO_SD_QUANT_ISA=avx2 forces the AVX2 kernel
    (tests compare both on an AVX-512 machine)."""
    flags = cpu_flags()
    forced = os.environ.get("HETERO_SD_QUANT_ISA")
    if "avx512f" in flags and forced != "avx2":
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def enabled() -> bool:
    return os.environ.get("HETERO_SD_QUANT", "on").lower() not in ("off", "0", "no", "false")


@functools.cache
def extension():
    """The compiled kernel module; raises KernelUnavailable with the reason (announced by the caller)."""
    if isa() is None:
        raise KernelUnavailable("this CPU has neither AVX-512 nor AVX2+FMA+F16C")
    return build("hetero_sd_quant", SOURCE)


def dequantize(kind: str, rows: np.ndarray) -> torch.Tensor:
    """GGUF rows [N, K/32 * block bytes] -> float32 [N, K], exactly as the converter computed them."""
    n = rows.shape[0]
    blocks = torch.from_numpy(np.array(rows)).view(n, -1, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if kind == Q8_0:
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).reshape(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 0xF, qs >> 4], -1).float()
    return (d * q + m).reshape(n, -1)


class Quantized:
    """A weight [in, out] kept as GGUF blocks, called like `x @ weight_t` for 1..MAX_ROWS rows; longer
    inputs go to `fallback` (the float32 weight or its gemm.Packed), see layers.linear."""

    def __init__(self, kind: str, rows: np.ndarray, fallback, weight_t: torch.Tensor | None = None):
        if kind not in BLOCK_BYTES:
            raise KernelUnavailable(f"{kind} blocks have no kernel here (only Q4_1 and Q8_0)")
        self.kind, self.fallback = kind, fallback
        self.n, self.k = rows.shape[0], rows.shape[1] // BLOCK_BYTES[kind] * 32
        self.setup(torch.from_numpy(np.array(rows)) if isinstance(rows, np.ndarray) else rows.contiguous(), weight_t)

    def setup(self, rows: torch.Tensor, weight_t: torch.Tensor | None) -> None:
        """This kernel's extension, ISA and packed blocks (after checking them against the float32 weights)."""
        self.ext, self.avx512 = extension(), isa() == "avx512"
        if weight_t is not None and not self.ext.matches(rows, self.kind == Q4_1, weight_t):
            raise ValueError("the GGUF blocks do not dequantize to the float32 weights")
        self.packed = self.ext.pack(rows, self.kind == Q4_1, 16 if self.avx512 else 8, 1, False)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and 1 <= x.numel() // self.k <= MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.autograd._profiler_enabled():  # a pybind call is no aten op: name it for torch.profiler
            with torch.profiler.record_function(f"hetero_sd::{self.label}_{self.kind}"):
                return self.product(x)
        return self.product(x)

    label = "qgemm"
    suffix = ""  # what the weights' name adds: these numerics are the float32 target's
    how = f"times bitwise the float32 weights' d, q and m, never dequantized ({isa()} kernel)"

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> [..., n]: the kernel takes the shapes (see qgemm)."""
        return self.ext.qgemm(x, self.packed, self.kind == Q4_1, self.avx512, self.n)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


# ---- the target's weights from its GGUF ----

WEIGHTS = "Q4_1/Q8_0 blocks from the GGUF"  # how stats and bench name the quantized target's weights
NOTE = "target weights"
LAYER_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


GGML_TYPES = {3: Q4_1, 8: Q8_0}  # ggml_type ids of the block formats the kernel multiplies


def gguf_tensors(path) -> dict[str, tuple[str, np.ndarray]]:
    """The Q4_1/Q8_0 tensors of a GGUF (v2/v3) as (kind, rows [out, bytes], memory-mapped): a header walk
    that skips the metadata (gguf.GGUFReader decodes every tokenizer string: seconds)."""
    import struct

    data = np.memmap(path, dtype=np.uint8, mode="r")
    at = 0

    def take(fmt):
        nonlocal at
        vals = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string():
        nonlocal at
        n = take("Q")
        at += n
        return bytes(data[at - n:at]).decode("utf-8", "replace")

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(kind):
        nonlocal at
        if kind in sizes:
            at += sizes[kind]
        elif kind == 8:
            n = take("Q")  # (not `at += take(...)`: that adds to the offset read before the call)
            at += n
        elif kind == 9:
            item, count = take("I"), take("Q")
            if item in sizes:
                at += sizes[item] * count
            else:
                for _ in range(count):
                    skip(item)
        else:
            raise ValueError(f"unknown GGUF metadata type {kind}")

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path} is not a GGUF v2+ file")
    alignment = 32
    for _ in range(n_kv):
        key, kind = string(), take("I")
        if key == "general.alignment" and kind == 4:
            alignment = take("I")
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name, dims = string(), take("I")
        shape = [take("Q") for _ in range(dims)]
        infos.append((name, shape, take("I"), take("Q")))
    start = -(-at // alignment) * alignment
    out = {}
    for name, shape, kind, offset in infos:
        if kind in GGML_TYPES and len(shape) == 2 and shape[0] % 32 == 0:
            row = shape[0] // 32 * BLOCK_BYTES[GGML_TYPES[kind]]
            out[name] = (GGML_TYPES[kind], data[start + offset:start + offset + row * shape[1]].reshape(shape[1], row))
    return out


def gguf_rows(path, cfg) -> dict[str, tuple[str, np.ndarray]]:
    """The GGUF's Q4_1/Q8_0 tensors as (kind, rows [out, bytes]) under our names ('embed', 'lm_head',
    (layer, 'q_proj'), ...), rows in the converted model's order: llama.cpp stores a Llama's q/k rows
    permuted, and transformers undoes that when converting (its _reverse_permute_weights)."""
    found = gguf_tensors(path)
    wanted = {"embed": "token_embd.weight", "lm_head": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        wanted.update({(i, key): f"blk.{i}.{name}.weight" for key, name in LAYER_GGUF.items()})
    out = {}
    for key, name in wanted.items():
        if name not in found:
            continue
        kind, rows = found[name]
        if cfg.model_type == "llama" and isinstance(key, tuple) and key[1] in ("q_proj", "k_proj"):
            heads = cfg.num_attention_heads if key[1] == "q_proj" else cfg.num_key_value_heads
            order = np.arange(rows.shape[0]).reshape(heads, rows.shape[0] // heads // 2, 2).swapaxes(2, 1).reshape(-1)
            rows = rows[order]
        out[key] = (kind, rows)
    return out


def attach(target, gguf, kernel=None) -> str | None:
    """Give a float32 CPU target's linear layers and lm_head the quantized kernel where its GGUF holds
    Q4_1/Q8_0 blocks that dequantize bitwise to its float32 weights. Returns the weights' name for stats,
    or None (float32 throughout), with the reason in target.notes where one is worth announcing.
    kernel: Quantized (the float32 target), or quant8.Int8Blocks (rows quantized to int8: another target)."""
    kernel = kernel or Quantized
    if gguf is None or target.device != "cpu" or target.dtype != torch.float32:
        return None
    if not enabled():
        target.notes.append(f"{NOTE}: float32 (HETERO_SD_QUANT=off; the GGUF's blocks are not used)")
        return None
    try:
        extension()
        rows = gguf_rows(gguf, target.config)
        plan = []  # (owner, attribute, kind, rows, float32 weight [in, out]) in the fused layouts
        for i, block in enumerate(target.layers):
            for attr, weight_t, parts in (("mm_qkv", block.wqkv, ("q_proj", "k_proj", "v_proj")),
                                          ("mm_o", block.wo, ("o_proj",)),
                                          ("mm_gate_up", block.w_gate_up, ("gate_proj", "up_proj")),
                                          ("mm_down", block.w_down, ("down_proj",))):
                got = [rows.get((i, p)) for p in parts]
                if all(g is not None for g in got) and len({g[0] for g in got}) == 1:
                    plan.append((block, attr, got[0][0], np.concatenate([g[1] for g in got]), weight_t))
        head = rows.get("embed" if target.config.tie_word_embeddings else "lm_head")
        if head is not None:
            plan.append((target, "mm_head", head[0], head[1], target.lm_head))
        if not plan:
            return None
        made = [(owner, attr, kernel(kind, r, getattr(owner, attr), w)) for owner, attr, kind, r, w in plan]
    except (KernelUnavailable, ValueError, OSError, KeyError) as e:
        target.notes.append(f"{NOTE}: float32 (the GGUF's Q4_1/Q8_0 blocks are not used: {e})")
        return None
    for owner, attr, q in made:
        setattr(owner, attr, q)
    target.head_blocks = head  # (kind, rows): the draft's head can multiply them too (target.draft_head)
    kinds = "/".join(sorted({q.kind for _, _, q in made}))
    total = sum(w.numel() for *_, w in plan)
    weights = f"{kinds} blocks from the GGUF" + made[0][2].suffix
    target.notes.append(
        f"{NOTE}: {weights}: decode and verify steps (1-{MAX_ROWS} rows) multiply {len(made)} of the target's "
        f"matrices by their GGUF blocks ({sum(q.nbytes for _, _, q in made) / 1e6:.0f} MB instead of "
        f"{total * 4 / 1e6:.0f} MB of float32), {made[0][2].how}; prefill uses the float32 copy")
    return weights
