#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

// R rows of x [., K] times the rows k0..k1 (one chunk) of a packed tile w [K][NB]: the chunk's sums are
// accumulated in float32 registers, then added in float64 to acc[r][0..NB). Every output is thus summed
// in the same order whatever the number of rows: chunks of KC terms in float32, chunks added in float64
// (rounding error ~KC terms' worth instead of K's: more accurate than MKL's sgemm).
constexpr int64_t KC = 32;
constexpr int64_t PF = 16;  // tile rows prefetched ahead (16 x 192 bytes = 3 KB)

template <int R>
__attribute__((target("avx512f"))) static void chunk512(const float* x, int64_t ldx, const float* w, int64_t k0,
                                                         int64_t k1, double* acc) {
  __m512 a[R][3];
  for (int r = 0; r < R; ++r) { a[r][0] = _mm512_setzero_ps(); a[r][1] = _mm512_setzero_ps(); a[r][2] = _mm512_setzero_ps(); }
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * 48;
    _mm_prefetch((const char*)(wk + PF * 48), _MM_HINT_T0);
    _mm_prefetch((const char*)(wk + PF * 48 + 16), _MM_HINT_T0);
    _mm_prefetch((const char*)(wk + PF * 48 + 32), _MM_HINT_T0);
    __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 3; ++j) {
      double* d = acc + r * 48 + 16 * j;
      __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(a[r][j]));
      __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r][j]), 1)));
      _mm512_storeu_pd(d, _mm512_add_pd(_mm512_loadu_pd(d), lo));
      _mm512_storeu_pd(d + 8, _mm512_add_pd(_mm512_loadu_pd(d + 8), hi));
    }
  }
}

template <int R>
__attribute__((target("avx2,fma"))) static void chunk256(const float* x, int64_t ldx, const float* w, int64_t k0,
                                                          int64_t k1, double* acc) {
  __m256 a[R][3];
  for (int r = 0; r < R; ++r) { a[r][0] = _mm256_setzero_ps(); a[r][1] = _mm256_setzero_ps(); a[r][2] = _mm256_setzero_ps(); }
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * 24;
    _mm_prefetch((const char*)(wk + PF * 24), _MM_HINT_T0);
    _mm_prefetch((const char*)(wk + PF * 24 + 16), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
      a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 3; ++j) {
      double* d = acc + r * 24 + 8 * j;
      __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(a[r][j]));
      __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(a[r][j], 1));
      _mm256_storeu_pd(d, _mm256_add_pd(_mm256_loadu_pd(d), lo));
      _mm256_storeu_pd(d + 4, _mm256_add_pd(_mm256_loadu_pd(d + 4), hi));
    }
  }
}

using Chunk = void (*)(const float*, int64_t, const float*, int64_t, int64_t, double*);

static Chunk pick512(int r) {
  switch (r) { case 1: return chunk512<1>; case 2: return chunk512<2>; case 3: return chunk512<3>; case 4: return chunk512<4>;
               case 5: return chunk512<5>; case 6: return chunk512<6>; case 7: return chunk512<7>; default: return chunk512<8>; }
}
static Chunk pick256(int r) {
  switch (r) { case 1: return chunk256<1>; case 2: return chunk256<2>; case 3: return chunk256<3>; default: return chunk256<4>; }
}

// w [K, N] (x @ w layout) -> [ceil(N/nb)][K][nb], zero-padded columns.
at::Tensor pack(at::Tensor w, int64_t nb) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: a float32 matrix");
  int64_t K = w.size(0), N = w.size(1), tiles = (N + nb - 1) / nb;
  auto padded = at::zeros({K, tiles * nb}, w.options());
  padded.narrow(1, 0, N).copy_(w);
  return padded.view({K, tiles, nb}).permute({1, 0, 2}).contiguous();
}

// x [M, K] contiguous float32, packed [tiles][K][nb] -> y [M, n]
at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n, bool avx512) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2, "gemm: contiguous float32 rows");
  int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), nb = packed.size(2);
  TORCH_CHECK(packed.size(1) == K && nb == (avx512 ? 48 : 24), "gemm: packed weight does not fit");
  auto y = at::empty({M, tiles * nb}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = packed.data_ptr<float>(); float* yp = y.data_ptr<float>();
  int64_t ldy = tiles * nb, rows_max = avx512 ? 8 : 4;
  // Tiles split across threads. Within a tile, each chunk of KC weight rows is used by every row block
  // while it is in L1: the weight streams from memory exactly once, whatever M is.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(M * nb);
    for (int64_t t = begin; t < end; ++t) {
      const float* w = wp + t * K * nb;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t k1 = std::min(K, k0 + KC);
        for (int64_t r0 = 0; r0 < M; r0 += rows_max) {
          int r = (int)std::min(rows_max, M - r0);
          Chunk f = avx512 ? pick512(r) : pick256(r);
          f(xp + r0 * K, K, w, k0, k1, acc.data() + r0 * nb);
        }
      }
      for (int64_t r = 0; r < M; ++r)
        for (int64_t i = 0; i < nb; ++i) yp[r * ldy + t * nb + i] = (float)acc[r * nb + i];
    }
  });
  return n == ldy ? y : y.narrow(1, 0, n);
}

TORCH_LIBRARY(hetero_sd_gemm, m) {  // torch.ops.hetero_sd_gemm.*: the dispatcher releases the GIL around a call
  m.def("pack(Tensor w, int nb) -> Tensor");
  m.def("gemm(Tensor x, Tensor packed, int n, bool avx512) -> Tensor");
}
TORCH_LIBRARY_IMPL(hetero_sd_gemm, CPU, m) {
  m.impl("pack", &pack);
  m.impl("gemm", &gemm);
}
