// RMSNorm (with the residual add before it) and RoPE on q and k with the K/V cache write: rms_norm,
// add_rms_norm, rope_qkv, rope_slots. Part of fused.cpp (included there, after its standard headers).
#pragma once

static double sum_squares_in_order(const float* x, int64_t H) {
  double s = 0.0;
  for (int64_t i = 0; i < H; ++i) s += (double)x[i] * (double)x[i];
  return s;
}

#if defined(__x86_64__)
// sum of x^2 in double: 8 lanes (two chains of 4) over i in steps of 8, then a fixed tree, then the tail
// in order. x^2 is exact in double, so each fma rounds once, as s + x*x would.
__attribute__((target("avx2,fma"))) static double sum_squares(const float* x, int64_t H) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  const __m256d a = _mm256_add_pd(a0, a1);
  const __m128d b = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  double s = _mm_cvtsd_f64(_mm_add_sd(b, _mm_unpackhi_pd(b, b)));
  for (; i < H; ++i) s += (double)x[i] * (double)x[i];
  return s;
}
static bool has_avx2() { static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); return yes; }
#else
static double sum_squares(const float* x, int64_t H) { return sum_squares_in_order(x, H); }
static bool has_avx2() { return false; }
#endif

// y = w * (x * 1/sqrt(mean(x^2) + eps)) for one row of H floats (sum in double: order fixed, accurate).
// Machines without AVX2 sum in order: another order, but every row of a machine sums the same way.
static inline void norm_row(const float* x, const float* w, double eps, int64_t H, float* y) {
  const double s = has_avx2() ? sum_squares(x, H) : sum_squares_in_order(x, H);
  const float r = (float)(1.0 / std::sqrt(s / (double)H + eps));
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  const int64_t H = xc.size(-1), T = xc.numel() / H;
  const float *xp = xc.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) { for (int64_t t = b; t < e; ++t) norm_row(xp + t * H, wp, eps, H, yp + t * H); });
  return y;
}

// (h + d, rms_norm(h + d)): the residual add and the next norm in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor h, at::Tensor d, at::Tensor w, double eps) {
  auto hc = h.contiguous(), dc = d.contiguous();
  auto s = at::empty_like(hc), y = at::empty_like(hc);
  const int64_t H = hc.size(-1), T = hc.numel() / H;
  const float *hp = hc.data_ptr<float>(), *dp = dc.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t i = t * H; i < (t + 1) * H; ++i) sp[i] = hp[i] + dp[i];
      norm_row(sp + t * H, wp, eps, H, yp + t * H);
    }
  });
  return std::make_tuple(s, y);
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

#if defined(__x86_64__)
// rope_row, 8 lanes: the same multiplies and adds per element (the target has no FMA: nothing can be
// contracted), so the same bits as the scalar loop; the tail of a half that is not a multiple of 8 by it
__attribute__((target("avx2"))) static void rope_row8(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
    const __m256 neg_hi = _mm256_xor_ps(hi, _mm256_set1_ps(-0.0f));
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)), _mm256_mul_ps(neg_hi, _mm256_loadu_ps(s + i))));
    _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + i))));
  }
  for (; i < half; ++i) {
    out[i] = x[i] * c[i] + -x[i + half] * s[i];
    out[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
  }
}
static inline void rope_any(const float* x, const float* c, const float* s, int64_t D, float* out) {
  if (has_avx2()) rope_row8(x, c, s, D, out); else rope_row(x, c, s, D, out);
}
// n floats to float16 at dst[i * stride], rounded to nearest even by F16C 8 at a time (c10::Half's scalar
// conversion gives the same bits for every finite value at ~15 cycles each: most of a verify row's RoPE op)
__attribute__((target("avx2,f16c"))) static void halves8(const float* src, at::Half* dst, int64_t n, int64_t stride) {
  int64_t i = 0;
  alignas(16) uint16_t h[8];
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    if (stride == 1) { _mm_storeu_si128((__m128i*)(dst + i), v); continue; }
    _mm_store_si128((__m128i*)h, v);
    for (int u = 0; u < 8; ++u) std::memcpy(dst + (i + u) * stride, h + u, 2);
  }
  for (; i < n; ++i) dst[i * stride] = at::Half(src[i]);
}
static inline void to_halves(const float* src, at::Half* dst, int64_t n, int64_t stride) {
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (f16c) { halves8(src, dst, n, stride); return; }
  for (int64_t i = 0; i < n; ++i) dst[i * stride] = at::Half(src[i]);
}
#else
static inline void to_halves(const float* src, at::Half* dst, int64_t n, int64_t stride) {
  for (int64_t i = 0; i < n; ++i) dst[i * stride] = at::Half(src[i]);
}
static inline void rope_any(const float* x, const float* c, const float* s, int64_t D, float* out) { rope_row(x, c, s, D, out); }
#endif

// A q8_0 K cache (rope_one<.., true>): K as q8_0 blocks (attend_q8.h: tiled, rows of D codes and D/32 float scales), V float16.
static inline int64_t q8_width(int64_t D) { return D + D / 8; }
#if defined(__x86_64__)
static void k_to_q8(const float* k, int64_t D, uint8_t* tile, int64_t j);  // attend_q8.h
static bool has_q8_k() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  return yes;
}
#else
static void k_to_q8(const float*, int64_t, uint8_t*, int64_t) {}
static bool has_q8_k() { return false; }
#endif

// qkv [1, T, (nh + 2 nkv) * D] -> q [1, nh, T, D] with RoPE; k (with RoPE) and v written to the caches
// [1, nkv, capacity, D] at positions start..start+T-1 (the caches' views over [0, start+T) are made by the
// caller: an op's outputs do not alias its inputs). With q_norm/k_norm (Qwen3-style layers: an RMSNorm of
// each head's row before RoPE, the DFlash drafts among them) each head row is normed first, as norm_row does.
// One row of q|k|v at position p: q's heads (with RoPE) to q_out + h * q_stride; k (with RoPE, tiled or not) and v
// into the caches whose K/V head h starts at kbase/vbase + h * cap * D. With qn/kn each head row is normed first.
// Q8: K as q8_0 blocks into its tile (attend_q8.h), V float16.
template <typename KV, bool Q8 = false>
static void rope_one(const float* row, const float* c, const float* s, int64_t D, int64_t nh, int64_t nkv,
                     const float* qn, const float* kn, double eps, float* q_out, int64_t q_stride,
                     std::conditional_t<Q8, uint8_t, KV>* kbase, KV* vbase, int64_t cap, int64_t p, bool tiled) {
  constexpr bool half = std::is_same<KV, at::Half>::value;  // a float16 cache (llama.cpp's): rounded to nearest even
  float normed[256], rotated[256];
  auto head = [&](const float* in, const float* w) -> const float* {
    if (w == nullptr) return in;
    norm_row(in, w, eps, D, normed);
    return normed;
  };
  for (int64_t h = 0; h < nh; ++h) rope_any(head(row + h * D, qn), c, s, D, q_out + h * q_stride);
  for (int64_t h = 0; h < nkv; ++h) {
    const int64_t at = (h * cap + p) * D;
    const float* v = row + (nh + nkv + h) * D;
    // K tiled: into its tile of 16 positions, d-major (attend's tiled scores); V as ever
    const int64_t kat = tiled ? h * cap * D + p / 16 * 16 * D + p % 16 : at, kstride = tiled ? 16 : 1;
    rope_any(head(row + (nh + h) * D, kn), c, s, D, rotated);
    if constexpr (Q8) {
      k_to_q8(rotated, D, kbase + (h * cap + p / 16 * 16) * q8_width(D), p % 16);
      to_halves(v, vbase + at, D, 1);
    } else if constexpr (half) {
      to_halves(rotated, kbase + kat, D, kstride);
      to_halves(v, vbase + at, D, 1);
    } else {
      for (int64_t i = 0; i < D; ++i) kbase[kat + i * kstride] = rotated[i];
      std::memcpy(vbase + at, v, D * sizeof(float));
    }
  }
}

// The caches' kinds: float32 or float16 K and V, or a q8_0 K (uint8, attend_q8.h) with a float16 V
enum class Caches { F32, F16, Q8K };
static Caches caches_kind(const at::Tensor& kc, const at::Tensor& vc, int64_t D, bool tiled, const char* op) {
  if (kc.scalar_type() == at::kByte) {
    TORCH_CHECK(vc.scalar_type() == at::kHalf && tiled && D % 32 == 0 && D <= 256 && kc.size(-1) == q8_width(D) &&
                    vc.size(-1) == D && has_q8_k(),
                op, ": a q8_0 K cache takes a float16 V, the tiled layout, a head of whole blocks of 32, rows of D + D/8 "
                "bytes and AVX512-VNNI");
    return Caches::Q8K;
  }
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kHalf),
              op, ": float32 or float16 caches, or a q8_0 K with a float16 V");
  return kc.scalar_type() == at::kHalf ? Caches::F16 : Caches::F32;
}

// rope_one into caches of that kind, K and V of the row's slot starting kat / vat elements into them
static void rope_into(Caches kind, const float* row, const float* c, const float* s, int64_t D, int64_t nh, int64_t nkv,
                      const float* qn, const float* kn, double eps, float* q_out, int64_t q_stride, const at::Tensor& kc,
                      const at::Tensor& vc, int64_t kat, int64_t vat, int64_t cap, int64_t p, bool tiled) {
  if (kind == Caches::Q8K)
    rope_one<at::Half, true>(row, c, s, D, nh, nkv, qn, kn, eps, q_out, q_stride, kc.data_ptr<uint8_t>() + kat,
                             vc.data_ptr<at::Half>() + vat, cap, p, tiled);
  else if (kind == Caches::F16)
    rope_one<at::Half>(row, c, s, D, nh, nkv, qn, kn, eps, q_out, q_stride, kc.data_ptr<at::Half>() + kat,
                       vc.data_ptr<at::Half>() + vat, cap, p, tiled);
  else
    rope_one<float>(row, c, s, D, nh, nkv, qn, kn, eps, q_out, q_stride, kc.data_ptr<float>() + kat,
                    vc.data_ptr<float>() + vat, cap, p, tiled);
}

at::Tensor rope_qkv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor kc, at::Tensor vc, int64_t start,
                    int64_t nh, int64_t nkv, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                    double eps, bool tiled) {
  auto x = qkv.contiguous();
  auto cs = cos.contiguous(), sn = sin.contiguous();
  const int64_t T = x.size(1), D = cs.size(-1), W = (nh + 2 * nkv) * D, cap = kc.size(2);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value() && D <= 256, "rope_qkv: both q/k norms or neither, D <= 256");
  TORCH_CHECK(!tiled || cap % 16 == 0, "rope_qkv: a tiled K cache holds whole tiles of 16 positions");
  auto q = at::empty({1, nh, T, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->contiguous().data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->contiguous().data_ptr<float>() : nullptr;
  const Caches kind = caches_kind(kc, vc, D, tiled, "rope_qkv");
  float* qp = q.data_ptr<float>();
  // rows in parallel (each row alone: the same bits)
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      rope_into(kind, xp + t * W, cp + t * D, sp + t * D, D, nh, nkv, qn, kn, eps, qp + t * D, T * D, kc, vc, 0, 0, cap,
                start + t, tiled);
  });
  return q;
}

// Slots: R rows, each ONE token of its own sequence (batched data generation): row r at position pos[r] of the
// cache slot slots[r] (caches [S, nkv, cap, D]); cos/sin [R, D] are the rows' own. Each row takes exactly the
// steps rope_qkv gives a decode step's row, so a slot's sequence has the bits the runtime's decoding gives it.
at::Tensor rope_slots(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor kc, at::Tensor vc, at::Tensor slots,
                      at::Tensor pos, int64_t nh, int64_t nkv, c10::optional<at::Tensor> q_norm,
                      c10::optional<at::Tensor> k_norm, double eps, bool tiled) {
  auto x = qkv.contiguous();
  auto cs = cos.contiguous(), sn = sin.contiguous();
  auto sl = slots.to(at::kLong).contiguous(), ps = pos.to(at::kLong).contiguous();
  const int64_t D = cs.size(-1), W = (nh + 2 * nkv) * D, R = x.numel() / W, S = kc.size(0), cap = kc.size(2);
  TORCH_CHECK(cs.numel() == R * D && sl.numel() == R && ps.numel() == R && D <= 256 && kc.size(1) == nkv,
              "rope_slots: one cos/sin row, slot and position per row");
  TORCH_CHECK(!tiled || cap % 16 == 0, "rope_slots: a tiled K cache holds whole tiles of 16 positions");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "rope_slots: contiguous caches");
  const Caches kind = caches_kind(kc, vc, D, tiled, "rope_slots");
  const int64_t *slp = sl.data_ptr<int64_t>(), *pp = ps.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(slp[r] >= 0 && slp[r] < S && pp[r] >= 0 && pp[r] < cap, "rope_slots: slot or position out of range");
  auto q = at::empty({R, nh, 1, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->contiguous().data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->contiguous().data_ptr<float>() : nullptr;
  float* qp = q.data_ptr<float>();
  const int64_t k_slot = nkv * cap * kc.size(-1), v_slot = nkv * cap * D;
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      rope_into(kind, xp + r * W, cp + r * D, sp + r * D, D, nh, nkv, qn, kn, eps, qp + r * nh * D, D, kc, vc,
                slp[r] * k_slot, slp[r] * v_slot, cap, pp[r], tiled);
  });
  return q;
}
