#include <ATen/ATen.h>
#include <torch/library.h>
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
at::Tensor qgemm(at::Tensor x_in, at::Tensor packed, bool q41, bool avx512, int64_t n) {
  auto x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "qgemm: float32 rows");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.dim() == 3, "qgemm: packed blocks");
  int64_t K = x.size(-1), M = x.numel() / K, tiles = packed.size(0), KB = packed.size(1), bytes = packed.size(2);
  int64_t nb = avx512 ? 16 : 8;
  TORCH_CHECK(KB * 32 == K && bytes == (q41 ? 20 : 34) * nb && n <= tiles * nb && n > (tiles - 1) * nb,
              "qgemm: packed weight does not fit x or this ISA");
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
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
at::Tensor pack(at::Tensor rows, bool q41, int64_t nb, int64_t group, bool flip128) {
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == at::kByte && rows.dim() == 2, "pack: GGUF rows");
  int64_t bb = q41 ? 20 : 34, head = q41 ? 4 : 2, N = rows.size(0), KB = rows.size(1) / bb, tiles = (N + nb - 1) / nb;
  TORCH_CHECK(KB * bb == rows.size(1) && (bb - head) % group == 0, "pack: rows are not whole blocks");
  const uint8_t flip = flip128 && !q41 ? 0x80 : 0;
  auto out = at::zeros({tiles, KB, bb * nb}, rows.options());
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
bool matches(at::Tensor rows, bool q41, at::Tensor w_t) {
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == at::kByte && w_t.scalar_type() == at::kFloat, "matches: types");
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

TORCH_LIBRARY(hetero_sd_quant, m) {  // torch.ops.hetero_sd_quant.*: the dispatcher releases the GIL around a call
  m.def("qgemm(Tensor x, Tensor packed, bool q41, bool avx512, int n) -> Tensor");
  m.def("pack(Tensor rows, bool q41, int nb, int group, bool flip128) -> Tensor");
  m.def("matches(Tensor rows, bool q41, Tensor w_t) -> bool");
}
TORCH_LIBRARY_IMPL(hetero_sd_quant, CPU, m) {
  m.impl("qgemm", &qgemm);
  m.impl("pack", &pack);
  m.impl("matches", &matches);
}
