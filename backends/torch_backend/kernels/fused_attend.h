// Attention over the K/V cache, each query row summed as if alone: attend, attend_slots (and, with
// attend_q8.h, a q8_0 K cache). Part of fused.cpp (included after fused_norm_rope.h, whose cache kinds it reads).
#pragma once

#if defined(__x86_64__)
// ---- causal attention, each query row summed as if alone (decode and verify agree bit for bit) ----
// torch's SDPA sums in a different order for one query row than for a block of rows, and int8 rows
// (quant8.py) turn that 1e-6 into different codes. Here each (row, head) takes the same operations in the
// same order whatever the number of rows: scores q.k_j in 8- or 16-lane sums reduced in a fixed tree (over
// a K cache tiled by 16 positions: one fma chain per key, scores_tiled), exp by one polynomial, sum and weighted values accumulated over j in order. Rows only share memory traffic:
// a chunk of keys serves all rows of a work item while it is in L1 (attend_rows). AVX2, and a 16-lane
// AVX-512 variant (~1.2x on a verify block; a machine uses one of them for every row).
__attribute__((target("avx2,fma,f16c"))) static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// K/V rows as float32 or float16 (a float16 cache: converted as loaded, 8 or 16 lanes at a time)
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
__attribute__((target("avx512f"))) static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// e^x for -87 <= x <= 88 (Cephes expf: ~1 ulp; below -87 it gives e^-87), 8 lanes
__attribute__((target("avx2,fma,f16c"))) static inline __m256 exp8(__m256 x) {
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

// 8 keys' partial sums (one vector each) to their 8 scores by one transposing tree: every key is summed
// ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) wherever it sits in its group of 8
__attribute__((target("avx2,fma,f16c"))) static inline __m256 reduce8(const __m256* a) {
  __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h4, 0x20), _mm256_permute2f128_ps(h0, h4, 0x31));
}

// Each row's attention runs in three stages over its n keys: scores (and their max), softmax weights,
// weighted values. The scores and values stages take the keys in chunks, so that a chunk of K (or V)
// read once from L2 serves every row of a work item from L1 (a verify block's rows and the heads that
// share a K/V head); per row, every sum is taken in the same order as for that row alone.

// 8-lane stages. scores: s[j] = q.k_j * scale for j in [j0, j1) (j0 a multiple of 8; a group past the
// last key repeats it: the max is unchanged), 8 independent sums reduced by reduce8; mx: 8 running maxima
template <int D, typename KV>
__attribute__((target("avx2,fma,f16c"))) static void scores8(const float* q, const KV* kc, int64_t j0, int64_t j1, int64_t n,
                                                         float scale, float* s, float* mx) {
  __m256 qv[D / 8];
  for (int d = 0; d < D; d += 8) qv[d / 8] = _mm256_loadu_ps(q + d);
  __m256 m = _mm256_loadu_ps(mx);
  for (int64_t j = j0; j < j1; j += 8) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) {
      const KV* k = kc + std::min(j + u, n - 1) * D;
      a[u] = _mm256_mul_ps(qv[0], load8(k));
      for (int d = 8; d < D; d += 8) a[u] = _mm256_fmadd_ps(qv[d / 8], load8(k + d), a[u]);
    }
    const __m256 sc = _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale));
    _mm256_storeu_ps(s + j, sc);
    m = _mm256_max_ps(m, sc);
  }
  _mm256_storeu_ps(mx, m);
}

// s[j] <- e^(s[j] - max), in place, padded to the group of 8 with zeros; 1 / their sum
__attribute__((target("avx2,fma,f16c"))) static float weights8(float* s, int64_t n, const float* mx) {
  float top = mx[0];
  for (int i = 1; i < 8; ++i) top = std::max(top, mx[i]);
  for (int64_t j = n; j < (n + 7) / 8 * 8; ++j) s[j] = -INFINITY;  // e^-inf = 0
  __m256 sum = _mm256_setzero_ps(), m = _mm256_set1_ps(top);
  for (int64_t j = 0; j < n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / hsum8(sum);
}

// acc += sum_{j in [j0, j1)} s[j] v_j, over j in order (one chain per output lane)
template <int D, typename KV>
__attribute__((target("avx2,fma,f16c"))) static void values8(const float* s, const KV* vc, int64_t j0, int64_t j1, float* acc) {
  __m256 a[D / 8];
  for (int d = 0; d < D; d += 8) a[d / 8] = _mm256_loadu_ps(acc + d);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 w = _mm256_set1_ps(s[j]);
    for (int d = 0; d < D; d += 8) a[d / 8] = _mm256_fmadd_ps(w, load8(vc + j * D + d), a[d / 8]);
  }
  for (int d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, a[d / 8]);
}

template <int D>
__attribute__((target("avx2,fma,f16c"))) static void finish8(const float* acc, float inv, float* o) {
  for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), _mm256_set1_ps(inv)));
}

// ---- the 16-lane AVX-512 stages: 16 keys per score vector, two value chains (even and odd keys) ----
// Another summation order than the 8-lane one, so a machine uses one of them for every row (chosen once
// per process from the CPU's flags): decode and verify still agree bit for bit.
__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x) {  // as exp8
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

// 16 keys' partial-sum vectors -> the vector of their 16 totals, by one fixed transposing tree
__attribute__((target("avx512f"))) static inline __m512 reduce16(const __m512* a) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // keys 2i, 2i+1: 8 lanes each
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // keys 4i..4i+3: one 128-bit lane (4 partials) each
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // 128-bit lane l: keys l and 4+l (w[0]), 8+l and 12+l (w[1]), 2 partials each
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  // lane 4l + c holds key 4c + l: back to key order
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

template <int D, typename KV>
__attribute__((target("avx512f"))) static void scores16(const float* q, const KV* kc, int64_t j0, int64_t j1, int64_t n,
                                                          float scale, float* s, float* mx) {
  __m512 qv[D / 16];
  for (int d = 0; d < D; d += 16) qv[d / 16] = _mm512_loadu_ps(q + d);
  __m512 m = _mm512_loadu_ps(mx);
  for (int64_t j = j0; j < j1; j += 16) {
    __m512 a[16];
    for (int u = 0; u < 16; ++u) {
      const KV* k = kc + std::min(j + u, n - 1) * D;
      a[u] = _mm512_mul_ps(qv[0], load16(k));
      for (int d = 16; d < D; d += 16) a[u] = _mm512_fmadd_ps(qv[d / 16], load16(k + d), a[u]);
    }
    const __m512 sc = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + j, sc);
    m = _mm512_max_ps(m, sc);
  }
  _mm512_storeu_ps(mx, m);
}

__attribute__((target("avx512f"))) static float weights16(float* s, int64_t n, const float* mx) {
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(mx)));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 real = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(real, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// acc [even keys' D | odd keys' D] += s[j] v_j for j in [j0, j1); j0 even (chunks hold an even number of keys)
template <int D, typename KV>
__attribute__((target("avx512f"))) static void values16(const float* s, const KV* vc, int64_t j0, int64_t j1, float* acc) {
  __m512 ev[D / 16], od[D / 16];
  for (int d = 0; d < D; d += 16) { ev[d / 16] = _mm512_loadu_ps(acc + d); od[d / 16] = _mm512_loadu_ps(acc + D + d); }
  int64_t j = j0;
  for (; j + 1 < j1; j += 2) {
    const __m512 w0 = _mm512_set1_ps(s[j]), w1 = _mm512_set1_ps(s[j + 1]);
    for (int d = 0; d < D; d += 16) {
      ev[d / 16] = _mm512_fmadd_ps(w0, load16(vc + j * D + d), ev[d / 16]);
      od[d / 16] = _mm512_fmadd_ps(w1, load16(vc + (j + 1) * D + d), od[d / 16]);
    }
  }
  if (j < j1) {
    const __m512 w0 = _mm512_set1_ps(s[j]);
    for (int d = 0; d < D; d += 16) ev[d / 16] = _mm512_fmadd_ps(w0, load16(vc + j * D + d), ev[d / 16]);
  }
  for (int d = 0; d < D; d += 16) { _mm512_storeu_ps(acc + d, ev[d / 16]); _mm512_storeu_ps(acc + D + d, od[d / 16]); }
}

// values16 for RR rows (2-6) at once over the same keys [j0, j1) (j0, j1 even; D = 64): each V row loaded and
// converted once for all RR rows, the even keys in one pass and the odd keys in another, so each row's two chains
// are values16's, in its order (bitwise the same); 4 RR accumulators and a key's 4 vectors fit the 32 registers.
// A verify's item holds 12 query rows (4 tokens x 3 heads of a K/V head): two passes of six (one parity a pass:
// interleaving both left the fma ports idle, 3.9-4.2 against 3.4-3.5 us for 12 rows x 512 keys on the 2-core
// Zen 5); one row alone keeps values16's interleaved chains (latency).
template <int RR, typename KV>
__attribute__((target("avx512f"))) static void values16_rows(const float* const* s, const KV* vc, int64_t j0, int64_t j1,
                                                             float* const* acc) {
  constexpr int D = 64;
  for (int parity = 0; parity < 2; ++parity) {
    __m512 a[RR][4];
    for (int r = 0; r < RR; ++r)
      for (int d = 0; d < 4; ++d) a[r][d] = _mm512_loadu_ps(acc[r] + parity * D + 16 * d);
    for (int64_t j = j0 + parity; j < j1; j += 2) {
      __m512 v[4];
      for (int d = 0; d < 4; ++d) v[d] = load16(vc + j * D + 16 * d);
      for (int r = 0; r < RR; ++r) {
        const __m512 w = _mm512_set1_ps(s[r][j]);
        for (int d = 0; d < 4; ++d) a[r][d] = _mm512_fmadd_ps(w, v[d], a[r][d]);
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int d = 0; d < 4; ++d) _mm512_storeu_ps(acc[r] + parity * D + 16 * d, a[r][d]);
  }
}

template <typename KV>
static void values16_group(int rg, const float* const* s, const KV* vc, int64_t j0, int64_t j1, float* const* acc) {
  switch (rg) {
    case 2: values16_rows<2, KV>(s, vc, j0, j1, acc); break;
    case 3: values16_rows<3, KV>(s, vc, j0, j1, acc); break;
    case 4: values16_rows<4, KV>(s, vc, j0, j1, acc); break;
    case 5: values16_rows<5, KV>(s, vc, j0, j1, acc); break;
    default: values16_rows<6, KV>(s, vc, j0, j1, acc); break;
  }
}

template <int D>
__attribute__((target("avx512f"))) static void finish16(const float* acc, float inv, float* o) {
  for (int d = 0; d < D; d += 16)
    _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(acc + d), _mm512_loadu_ps(acc + D + d)), _mm512_set1_ps(inv)));
}

// The K and V a work item reads first come from memory (a layer's K/V, ~390 KB at 512 tokens, is not in the
// caches after the products have streamed their weights), and the hardware's prefetcher runs only a few lines
// ahead of the scores' four tile streams: the first pass over the tiles waits on memory while its fmas idle.
// So that pass requests, per step of its loop over d, the lines of the next tiles and an equal share of V's:
// K then stays one tile group ahead, and all of V is in the L2 by the time the weights' stage reads it. Only
// requests: no value changes.
struct Ahead {
  const char *k, *kend, *v, *vend;
  __attribute__((always_inline)) inline void step(int lines) {
    for (int i = 0; i < lines && k < kend; ++i, k += 64) _mm_prefetch(k, _MM_HINT_T0);
    for (int i = 0; i < lines && v < vend; ++i, v += 64) _mm_prefetch(v, _MM_HINT_T1);
  }
};

// RG rows x TB tiles of raw scores (tiles from t) times scale into s[r], each row's maximum over its real keys (lanes
// at keys >= n[r] are stored but kept out of it; the weights stages zero them)
template <int RG, int TB>
__attribute__((target("avx512f"), always_inline)) static inline void store_tiles16(const __m512 (&acc)[RG][TB], int64_t t, float scale,
                                                                                   const int64_t* n, float* const* s, float* const* mx) {
  for (int r = 0; r < RG; ++r) {
    __m512 m = _mm512_loadu_ps(mx[r]);
    for (int b = 0; b < TB; ++b) {
      const int64_t j = (t + b) * 16, left = n[r] - j;
      const __m512 sc = _mm512_mul_ps(acc[r][b], _mm512_set1_ps(scale));
      _mm512_storeu_ps(s[r] + j, sc);
      const __mmask16 real = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
      m = _mm512_mask_max_ps(m, real, m, sc);
    }
    _mm512_storeu_ps(mx[r], m);
  }
}

// ---- scores over a K cache tiled by 16 keys (rope_qkv with tiled=true: key j's d-th value at
// (j/16)*16*D + d*16 + j%16). A tile's 16 scores for one row are then the 16 lanes of one chain of D fmas over
// d in order: no transposing tree, and a tile loaded (and converted) once serves a group of rows from
// registers. Each key's score is a chain of its own, whatever rows or keys are beside it: decode and verify
// agree bit for bit, and the 8- and 16-lane stages give the same scores (the same fmas in the same order).
// RG rows x TB tiles from tile t; lanes at keys >= n[r] are stored but kept out of the row's maximum (the
// weights stages zero them).
template <int D, int RG, int TB, typename KV>
__attribute__((target("avx512f"))) static void tiles16(const float* const* q, const KV* kt, int64_t t, float scale, Ahead* ahead,
                                                       const int64_t* n, float* const* s, float* const* mx) {
  __m512 acc[RG][TB];
  for (int r = 0; r < RG; ++r)
    for (int b = 0; b < TB; ++b) acc[r][b] = _mm512_setzero_ps();
  const KV* base = kt + t * 16 * D;
  for (int d = 0; d < D; ++d) {
    if (ahead) ahead->step(TB * 16 * (int)sizeof(KV) / 64);  // a tile group's lines over its D steps
    __m512 kv[TB];
    for (int b = 0; b < TB; ++b) kv[b] = load16(base + b * 16 * D + d * 16);
    for (int r = 0; r < RG; ++r) {
      const __m512 qd = _mm512_set1_ps(q[r][d]);
      for (int b = 0; b < TB; ++b) acc[r][b] = _mm512_fmadd_ps(qd, kv[b], acc[r][b]);
    }
  }
  store_tiles16<RG, TB>(acc, t, scale, n, s, mx);
}

// the same chains 8 lanes at a time (a tile is two vectors), fewer rows and tiles at once: 16 registers
template <int D, int RG, int TB, typename KV>
__attribute__((target("avx2,fma,f16c"))) static void tiles8(const float* const* q, const KV* kt, int64_t t, float scale, Ahead* ahead,
                                                           const int64_t* n, float* const* s, float* const* mx) {
  __m256 acc[RG][2 * TB];
  for (int r = 0; r < RG; ++r)
    for (int b = 0; b < 2 * TB; ++b) acc[r][b] = _mm256_setzero_ps();
  const KV* base = kt + t * 16 * D;
  for (int d = 0; d < D; ++d) {  // (ahead: none here, see scores_tiled)
    __m256 kv[2 * TB];
    for (int b = 0; b < 2 * TB; ++b) kv[b] = load8(base + (b / 2) * 16 * D + d * 16 + (b % 2) * 8);
    for (int r = 0; r < RG; ++r) {
      const __m256 qd = _mm256_set1_ps(q[r][d]);
      for (int b = 0; b < 2 * TB; ++b) acc[r][b] = _mm256_fmadd_ps(qd, kv[b], acc[r][b]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < RG; ++r) {
    __m256 m = _mm256_loadu_ps(mx[r]);
    for (int b = 0; b < 2 * TB; ++b) {
      const int64_t j = t * 16 + b * 8, left = std::max<int64_t>(-1, std::min<int64_t>(8, n[r] - j));
      const __m256 sc = _mm256_mul_ps(acc[r][b], _mm256_set1_ps(scale));
      _mm256_storeu_ps(s[r] + j, sc);
      const __m256 real = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), lane));
      m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, real));
    }
    _mm256_storeu_ps(mx[r], m);
  }
}

template <int D, bool W, int RG, typename KV>
static void tiles_rows(const float* const* q, const KV* kt, int64_t tiles, float scale, const int64_t* n,
                       float* const* s, float* const* mx, Ahead* ahead) {
  // tiles at once: enough independent fma chains to cover the fma latency (a lone row would otherwise wait
  // on 4 chains of D dependent fmas), within the registers (16 on AVX2)
  constexpr int TB = W ? (RG == 1 ? 8 : 4) : (RG == 1 ? 4 : 2);
  int64_t t = 0;
  for (; t + TB <= tiles; t += TB) (W ? tiles16<D, RG, TB, KV> : tiles8<D, RG, TB, KV>)(q, kt, t, scale, ahead, n, s, mx);
  for (; t < tiles; ++t) (W ? tiles16<D, RG, 1, KV> : tiles8<D, RG, 1, KV>)(q, kt, t, scale, ahead, n, s, mx);
}

// every row's scores and maxima over a tiled K, rows in groups of up to 4 (AVX-512) or 2
template <int D, bool W, typename KV>
static void scores_tiled(const float* const* q, const KV* kt, const KV* vt, const int64_t* n, int R, float scale, float* s,
                         int64_t ss, float* mx) {
  constexpr int RGMAX = W ? 4 : 2;
  float* sr[RGMAX];
  float* mr[RGMAX];
  int64_t all = 0;
  for (int r = 0; r < R; ++r) all = std::max(all, n[r]);
  // the first group's pass requests K 8 tiles ahead of its loads, and every row's V (see Ahead); only on the
  // 16-lane path, the one measured (a decode row's one pass is its own stream: left alone, it ran 3% faster)
  const int64_t ktiles = (all + 15) / 16;
  Ahead ahead{(const char*)(kt + std::min<int64_t>(8, ktiles) * 16 * D), (const char*)(kt + ktiles * 16 * D),
              (const char*)vt, (const char*)(vt + all * D)};
  for (int r0 = 0; r0 < R; r0 += RGMAX) {
    const int rg = std::min(RGMAX, R - r0);
    Ahead* first = W && r0 == 0 && R > 1 ? &ahead : nullptr;
    int64_t most = 0;
    for (int r = 0; r < rg; ++r) { most = std::max(most, n[r0 + r]); sr[r] = s + (r0 + r) * ss; mr[r] = mx + 16 * (r0 + r); }
    const int64_t tiles = (most + 15) / 16;
    switch (rg) {
      case 1: tiles_rows<D, W, 1, KV>(q + r0, kt, tiles, scale, n + r0, sr, mr, first); break;
      case 2: tiles_rows<D, W, 2, KV>(q + r0, kt, tiles, scale, n + r0, sr, mr, first); break;
      case 3: tiles_rows<D, W, W ? 3 : 2, KV>(q + r0, kt, tiles, scale, n + r0, sr, mr, first); break;
      default: tiles_rows<D, W, W ? 4 : 2, KV>(q + r0, kt, tiles, scale, n + r0, sr, mr, first); break;
    }
  }
}

// R rows (query vectors of one K/V head): q[r], their key counts n[r] -> o[r]. Per-row scratch: s (stride
// ss floats), 16 maxima, 2D accumulators.
// Each row converts a float16 V as it loads it: the conversion rides along with the loads, where a chunk
// converted once into a scratch for all rows costs more in stores and reloads than it saves.
// The softmax and values stages after the scores (s, mx), whatever K the scores came from (attend_rows,
// attend_rows_q8): o[r] = sum_j softmax(s[r])_j v_j, over chunks of CH keys (each chunk of V from L1 for all R rows).
template <int D, bool W, typename KV>
static void weigh_values(float* const* o, const int64_t* n, int R, const KV* vc, float* s, int64_t ss, float* mx,
                         float* acc) {
  constexpr int64_t CH = D == 64 ? 64 : 32;  // keys per chunk: 16 KB of K (or V), kept in L1 across the rows
  int64_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, n[r]);
  std::fill(acc, acc + 2 * D * R, 0.0f);
  std::vector<float> inv(R);
  for (int r = 0; r < R; ++r) inv[r] = (W ? weights16 : weights8)(s + r * ss, n[r], mx + 16 * r);
  for (int64_t c = 0; c < most; c += CH) {
    int r = 0;
    if (W && D == 64)  // rows up to six at a time over their common even span, then each row's own rest
      while (R - r >= 2) {
        const int rg = std::min(6, R - r);
        int64_t common = c + CH;
        const float* sr[6];
        float* ar[6];
        for (int u = 0; u < rg; ++u) {
          common = std::min(common, n[r + u]);
          sr[u] = s + (r + u) * ss;
          ar[u] = acc + 2 * D * (r + u);
        }
        const int64_t both = c + std::max<int64_t>(0, common - c) / 2 * 2;
        if (both > c) values16_group<KV>(rg, sr, vc, c, both, ar);
        for (int u = r; u < r + rg; ++u)
          if (both < std::min(c + CH, n[u])) values16<D, KV>(s + u * ss, vc, both, std::min(c + CH, n[u]), acc + 2 * D * u);
        r += rg;
      }
    for (; r < R; ++r)
      if (c < n[r]) (W ? values16<D, KV> : values8<D, KV>)(s + r * ss, vc, c, std::min(c + CH, n[r]), acc + 2 * D * r);
  }
  for (int r = 0; r < R; ++r) (W ? finish16<D> : finish8<D>)(acc + 2 * D * r, inv[r], o[r]);
}

// TILED: K tiled by 16 keys (scores_tiled); the softmax and values stages are the same either way.
template <int D, bool W, bool TILED, typename KV>
static void attend_rows(const float* const* q, float* const* o, const int64_t* n, int R, const KV* kc,
                        const KV* vc, float scale, float* s, int64_t ss, float* mx, float* acc) {
  constexpr int64_t CH = D == 64 ? 64 : 32;
  int64_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, n[r]);
  std::fill(mx, mx + 16 * R, -INFINITY);
  if (TILED)
    scores_tiled<D, W, KV>(q, kc, vc, n, R, scale, s, ss, mx);
  else
    for (int64_t c = 0; c < most; c += CH)
      for (int r = 0; r < R; ++r)
        if (c < n[r]) (W ? scores16<D, KV> : scores8<D, KV>)(q[r], kc, c, std::min(c + CH, n[r]), n[r], scale, s + r * ss, mx + 16 * r);
  weigh_values<D, W, KV>(o, n, R, vc, s, ss, mx, acc);
}

#include "attend_q8.h"

// attend_rows for a head size, lane width and K layout (KT: K's element; uint8: a q8_0 K, AVX-512, tiled)
using AttendRows8 = void (*)(const float* const*, float* const*, const int64_t*, int, const uint8_t*, const at::Half*,
                             float, float*, int64_t, float*, float*);
template <typename KT, typename KV>
static auto attend_variant(int64_t D, bool wide, bool tiled) {
  if constexpr (std::is_same<KT, uint8_t>::value)
    return D == 64 ? (AttendRows8)attend_rows_q8<64> : (AttendRows8)attend_rows_q8<128>;
  else
    return tiled ? (D == 64 ? (wide ? attend_rows<64, true, true, KV> : attend_rows<64, false, true, KV>)
                          : (wide ? attend_rows<128, true, true, KV> : attend_rows<128, false, true, KV>))
               : (D == 64 ? (wide ? attend_rows<64, true, false, KV> : attend_rows<64, false, false, KV>)
                          : (wide ? attend_rows<128, true, false, KV> : attend_rows<128, false, false, KV>));
}

// q [1, nh, T, D] at positions start..start+T-1; caches [1, nkv, cap, D] -> o [1, T, nh*D]; D = 64 or 128.
// Caches float32, or float16 (llama.cpp's KV cache: half the bytes; each value converted exactly as loaded).
// wide: the AVX-512 stages (the caller checks the CPU has AVX-512F). causal=false: every row sees all
// start+T keys (a DFlash draft's block over its context). Work items: a decode step's heads one by one
// (9 items for 2 threads); a block of 2-4 rows head by head with all its rows (9 items: one item per K/V
// head gave 3 items to 2 threads, a verify-2's attention cost 1.6x a decode step's); larger blocks 4 rows at
// a time with every head of one K/V head. Grouping only shares memory traffic: a row's bits stay its own.
// f(K, V) with the caches' own element pointers (uint8 for a q8_0 K: the AVX-512 stages only)
template <typename F>
static at::Tensor on_caches(Caches kind, const at::Tensor& kc, const at::Tensor& vc, bool wide, const char* op, F&& f) {
  if (kind == Caches::Q8K) {
    TORCH_CHECK(wide, op, ": a q8_0 K cache takes the AVX-512 stages");
    return f(kc.data_ptr<uint8_t>(), vc.data_ptr<at::Half>());
  }
  if (kind == Caches::F16) return f(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>());
  return f(kc.data_ptr<float>(), vc.data_ptr<float>());
}

template <typename KT, typename KV>
static at::Tensor attend_on(at::Tensor q, const KT* kp, const KV* vp, int64_t nkv, int64_t cap, int64_t start, bool wide,
                            bool causal, bool tiled) {
  const int64_t nh = q.size(1), T = q.size(2), D = q.size(3);
  auto o = at::empty({1, T, nh * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const float scale = 1.0f / std::sqrt((float)D);
  const int64_t group = nh / nkv, rows = T <= 4 ? T : 4, heads = T <= 4 ? 1 : group;
  const int64_t per_g = (group / heads) * ((T + rows - 1) / rows), ss = (start + T + 31) / 16 * 16;
  auto run = attend_variant<KT, KV>(D, wide, tiled);
  const int64_t kw = std::is_same<KT, uint8_t>::value ? q8_width(D) : D;  // K's row width in elements
  at::parallel_for(0, nkv * per_g, 1, [&](int64_t begin, int64_t end) {
    const int64_t most = rows * heads;
    std::vector<float> s(most * ss), mx(16 * most), acc(2 * D * most);
    std::vector<const float*> qs(most);
    std::vector<float*> os(most);
    std::vector<int64_t> ns(most);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / per_g, h0 = g * group + (i % per_g) % (group / heads) * heads;
      const int64_t t0 = (i % per_g) / (group / heads) * rows;
      int R = 0;
      for (int64_t t = t0; t < std::min(t0 + rows, T); ++t)
        for (int64_t h = h0; h < h0 + heads; ++h, ++R) {
          qs[R] = qp + (h * T + t) * D; os[R] = op + t * nh * D + h * D; ns[R] = causal ? start + t + 1 : start + T;
        }
      run(qs.data(), os.data(), ns.data(), R, kp + g * cap * kw, vp + g * cap * D, scale, s.data(), ss, mx.data(), acc.data());
    }
  });
  return o;
}
at::Tensor attend(at::Tensor q, at::Tensor kc, at::Tensor vc, int64_t start, bool wide, bool causal, bool tiled) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "attend: contiguous q and caches");
  const int64_t nh = q.size(1), T = q.size(2), D = q.size(3), nkv = kc.size(1), cap = kc.size(2);
  TORCH_CHECK((D == 64 || D == 128) && nh % nkv == 0 && start + T <= cap && (!tiled || cap % 16 == 0), "attend: shapes");
  return on_caches(caches_kind(kc, vc, D, tiled, "attend"), kc, vc, wide, "attend", [&](auto kp, auto vp) {
    return attend_on(q, kp, vp, nkv, cap, start, wide, causal, tiled);
  });
}

// Slots (rope_slots): q [R, nh, 1, D], row r one query at position pos[r] over its own cache slot slots[r]
// (caches [S, nkv, cap, D]) -> o [R, 1, nh * D]. A work item is one row's query heads of one K/V head: they share
// each loaded tile (a row's bits are its own, as in attend_on, so each equals the runtime's decode step).
template <typename KT, typename KV>
static at::Tensor attend_slots_on(at::Tensor q, const KT* kp, const KV* vp, const int64_t* slp, const int64_t* pp,
                                  int64_t nkv, int64_t cap, bool wide, bool tiled) {
  const int64_t R = q.size(0), nh = q.size(1), D = q.size(3), group = nh / nkv;
  auto o = at::empty({R, 1, nh * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const float scale = 1.0f / std::sqrt((float)D);
  int64_t longest = 0;
  for (int64_t r = 0; r < R; ++r) longest = std::max(longest, pp[r] + 1);
  const int64_t ss = (longest + 31) / 16 * 16;
  auto run = attend_variant<KT, KV>(D, wide, tiled);
  const int64_t kw = std::is_same<KT, uint8_t>::value ? q8_width(D) : D;
  at::parallel_for(0, R * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(group * ss), mx(16 * group), acc(2 * D * group);
    std::vector<const float*> qs(group);
    std::vector<float*> os(group);
    std::vector<int64_t> ns(group);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nkv, g = i % nkv;
      for (int64_t u = 0; u < group; ++u) {
        const int64_t h = g * group + u;
        qs[u] = qp + (r * nh + h) * D; os[u] = op + r * nh * D + h * D; ns[u] = pp[r] + 1;
      }
      const int64_t base = (slp[r] * nkv + g) * cap;
      run(qs.data(), os.data(), ns.data(), (int)group, kp + base * kw, vp + base * D, scale, s.data(), ss, mx.data(), acc.data());
    }
  });
  return o;
}
at::Tensor attend_slots(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor slots, at::Tensor pos, bool wide, bool tiled) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && q.dim() == 4 && q.size(2) == 1,
              "attend_slots: contiguous q [R, nh, 1, D] and caches");
  auto sl = slots.to(at::kLong).contiguous(), ps = pos.to(at::kLong).contiguous();
  const int64_t R = q.size(0), nh = q.size(1), D = q.size(3), S = kc.size(0), nkv = kc.size(1), cap = kc.size(2);
  TORCH_CHECK((D == 64 || D == 128) && nh % nkv == 0 && sl.numel() == R && ps.numel() == R && (!tiled || cap % 16 == 0),
              "attend_slots: shapes");
  const int64_t *slp = sl.data_ptr<int64_t>(), *pp = ps.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(slp[r] >= 0 && slp[r] < S && pp[r] >= 0 && pp[r] < cap, "attend_slots: slot or position out of range");
  return on_caches(caches_kind(kc, vc, D, tiled, "attend_slots"), kc, vc, wide, "attend_slots", [&](auto kp, auto vp) {
    return attend_slots_on(q, kp, vp, slp, pp, nkv, cap, wide, tiled);
  });
}

#define HAS_ATTEND true
#else
at::Tensor attend(at::Tensor q, at::Tensor, at::Tensor, int64_t, bool, bool, bool) { TORCH_CHECK(false, "attend: x86-64 only"); return q; }
at::Tensor attend_slots(at::Tensor q, at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool, bool) { TORCH_CHECK(false, "attend_slots: x86-64 only"); return q; }
#define HAS_ATTEND false
#endif
