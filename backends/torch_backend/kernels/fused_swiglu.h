// SwiGLU's silu(gate) * up: silu_mul. Part of fused.cpp (included after fused_attend.h, whose exp8 it uses).
#pragma once

#if defined(__x86_64__)
// silu(g) * u = g / (1 + e^-g) * u, 8 lanes (e^x by exp8's polynomial, clamped to [-87, 88])
__attribute__((target("avx2,fma"))) static inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0f)));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// one row; the tail goes through the same vector code, so every element gets the same function
__attribute__((target("avx2,fma"))) static void silu_mul_row(const float* g, const float* u, int64_t I, float* y) {
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) _mm256_storeu_ps(y + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < I) {
    float gb[8] = {0}, ub[8] = {0}, yb[8];
    std::memcpy(gb, g + i, (I - i) * sizeof(float));
    std::memcpy(ub, u + i, (I - i) * sizeof(float));
    _mm256_storeu_ps(yb, silu_mul8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub)));
    std::memcpy(y + i, yb, (I - i) * sizeof(float));
  }
}
#define HAS_VECTOR_SILU true
#else
#define HAS_VECTOR_SILU false
static void silu_mul_row(const float*, const float*, int64_t, float*) {}
#endif

static void silu_mul_scalar(const float* g, const float* u, int64_t I, float* y) {
  for (int64_t i = 0; i < I; ++i) y[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}

// [.., 2I] (gate | up) -> [.., I]: silu(gate) * up; rows in parallel (each element alone: same bits)
at::Tensor silu_mul(at::Tensor gu) {
  auto x = gu.contiguous();
  const int64_t I2 = x.size(-1), I = I2 / 2, T = x.numel() / I2;
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto y = at::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool vec = HAS_VECTOR_SILU && has_avx2();
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      (vec ? silu_mul_row : silu_mul_scalar)(xp + t * I2, xp + t * I2 + I, I, yp + t * I);
  });
  return y;
}
