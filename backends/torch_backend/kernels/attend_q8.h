// A K cache of q8_0 blocks (llama.cpp's `-ctk q8_0`), its scores by integer dot products: included by fused.cpp
// (x86-64 only; it uses that file's Ahead, store_tiles16, weigh_values and at::Half), whose callers choose it by
// the cache's dtype (uint8). Why: a verify block's attention is bound by its float multiply-adds (16 rows x 9 heads
// x 512 keys x 64 dims, twice), not by its bytes; the scores' half as int8 x int8 dot products (vpdpbusd: 64
// multiply-adds an instruction, a float fma 16) took 0.36x the time of the float scores in a C++ loop (12 rows x
// 512 keys on the 2-core Zen 5: 1.2 vs 3.3 us), the whole op 0.83-0.87x at 8-16 rows (benchmarks/attend_rows.py).
// V stays float16, the weights and values stages float32, as with a float K.
//
// Numerics, as llama.cpp's q8_0 K cache: each key's D values (after RoPE) in blocks of 32, codes round(x * 127 /
// amax) (to nearest even) and a scale amax / 127 rounded to float16; each query quantized the same way when it is
// scored; score = sum over blocks b of (scale_q[b] * scale_k[b]) * (integer dot of the codes), times 1/sqrt(D).
// The integer sums are exact and every key's float epilogue is the same few operations in the same order whatever
// rows or keys are beside it: decode and verify rows still agree bit for bit.
//
// Layout: one K/V head's cache is [cap, D + D/8] bytes, tiled by 16 positions: a tile's 16 (D + D/8) bytes hold
// the codes as [D/4][16 keys][4 dims] (key j's dims 4g..4g+3 at g*64 + (j%16)*4: one 16-lane vpdpbusd operand per
// group of 4 dims), then the scales as [D/32][16 keys] floats. Codes are stored +128 (vpdpbusd multiplies unsigned
// by signed bytes); 128 times each query block's code sum is taken back from its integer sums.

// x[0..32) -> codes and the block's scale (amax / 127 as float16, returned as float); llama.cpp's quantize_row_q8_0
__attribute__((target("avx512f,avx512bw,f16c"))) static inline float q8_block(const float* x, int8_t* codes) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 id = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  _mm_storeu_si128((__m128i*)codes, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, id))));
  _mm_storeu_si128((__m128i*)(codes + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, id))));
  return _cvtsh_ss(_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT));
}

// one key's D values (after RoPE) into slot j (0..15) of its tile
static void k_to_q8(const float* k, int64_t D, uint8_t* tile, int64_t j) {
  alignas(64) int8_t codes[256];
  float* scales = (float*)(tile + 16 * D);
  for (int64_t b = 0; b < D / 32; ++b) scales[b * 16 + j] = q8_block(k + 32 * b, codes + 32 * b);
  for (int64_t g = 0; g < D / 4; ++g) {
    uint32_t w;
    std::memcpy(&w, codes + 4 * g, 4);
    w ^= 0x80808080u;  // each signed byte + 128, as unsigned
    std::memcpy(tile + g * 64 + j * 4, &w, 4);
  }
}

struct QueryQ8 {  // one query row of D <= 128, quantized as the keys are
  alignas(64) int8_t c[128];
  float d[4];
  int32_t back[4];  // 128 x the block's code sum (what the +128 of the key codes added)
};

static void q_to_q8(const float* q, int64_t D, QueryQ8& out) {
  for (int64_t b = 0; b < D / 32; ++b) {
    out.d[b] = q8_block(q + 32 * b, out.c + 32 * b);
    int32_t sum = 0;
    for (int64_t i = 32 * b; i < 32 * (b + 1); ++i) sum += out.c[i];
    out.back[b] = 128 * sum;
  }
}

// RG rows x TB tiles from tile t: the 16 scores of each (row, tile) (masked out of the row's maximum past n[r]),
// as tiles16 gives them for a float K
template <int D, int RG, int TB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void q8tiles(const QueryQ8* const* q, const uint8_t* kt, int64_t t,
                                                                          float scale, Ahead* ahead, const int64_t* n,
                                                                          float* const* s, float* const* mx) {
  constexpr int64_t TILE = 16 * (D + D / 8);
  const uint8_t* base = kt + t * TILE;
  __m512 f[RG][TB];
  for (int b = 0; b < D / 32; ++b) {
    __m512i acc[RG][TB];
    for (int r = 0; r < RG; ++r)
      for (int u = 0; u < TB; ++u) acc[r][u] = _mm512_setzero_si512();
    for (int g = 8 * b; g < 8 * (b + 1); ++g) {
      if (ahead) ahead->step(TB * 5);  // a tile group's K lines (and as many of V's) over its D/4 steps
      __m512i kz[TB];
      for (int u = 0; u < TB; ++u) kz[u] = _mm512_loadu_si512(base + u * TILE + g * 64);
      for (int r = 0; r < RG; ++r) {
        int32_t four;
        std::memcpy(&four, q[r]->c + 4 * g, 4);
        const __m512i qb = _mm512_set1_epi32(four);
        for (int u = 0; u < TB; ++u) acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], kz[u], qb);
      }
    }
    for (int u = 0; u < TB; ++u) {
      const __m512 dk = _mm512_loadu_ps((const float*)(base + u * TILE + 16 * D) + 16 * b);
      for (int r = 0; r < RG; ++r) {
        const __m512 p = _mm512_mul_ps(_mm512_set1_ps(q[r]->d[b]), dk);
        const __m512 x = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][u], _mm512_set1_epi32(q[r]->back[b])));
        f[r][u] = b == 0 ? _mm512_mul_ps(p, x) : _mm512_fmadd_ps(p, x, f[r][u]);
      }
    }
  }
  store_tiles16<RG, TB>(f, t, scale, n, s, mx);
}

// tiles at once: enough independent chains for a lone row, within the 32 registers for six (12 rows x 512 keys
// on the 2-core Zen 5: 1.2 us, the float K's scores 3.3)
template <int D, int RG>
static void q8tiles_rows(const QueryQ8* const* q, const uint8_t* kt, int64_t tiles, float scale, const int64_t* n,
                         float* const* s, float* const* mx, Ahead* ahead) {
  constexpr int TB = RG == 1 ? 8 : RG == 2 ? 4 : 2;
  int64_t t = 0;
  for (; t + TB <= tiles; t += TB) q8tiles<D, RG, TB>(q, kt, t, scale, ahead, n, s, mx);
  for (; t < tiles; ++t) q8tiles<D, RG, 1>(q, kt, t, scale, ahead, n, s, mx);
}

// R rows of one K/V head over a q8_0 K (kt) and a float16 V (vt): as attend_rows, with the rows quantized first
template <int D>
static void attend_rows_q8(const float* const* q, float* const* o, const int64_t* n, int R, const uint8_t* kt,
                           const at::Half* vt, float scale, float* s, int64_t ss, float* mx, float* acc) {
  constexpr int RGMAX = 6;
  constexpr int64_t TILE = 16 * (D + D / 8);
  thread_local std::vector<QueryQ8> held;
  if ((int)held.size() < R) held.resize(R);
  const QueryQ8* qr[RGMAX];
  float* sr[RGMAX];
  float* mr[RGMAX];
  int64_t all = 0;
  for (int r = 0; r < R; ++r) {
    q_to_q8(q[r], D, held[r]);
    all = std::max(all, n[r]);
  }
  std::fill(mx, mx + 16 * R, -INFINITY);
  const int64_t ktiles = (all + 15) / 16;
  Ahead ahead{(const char*)(kt + std::min<int64_t>(8, ktiles) * TILE), (const char*)(kt + ktiles * TILE),
              (const char*)vt, (const char*)(vt + all * D)};
  for (int r0 = 0; r0 < R; r0 += RGMAX) {
    const int rg = std::min(RGMAX, R - r0);
    Ahead* first = r0 == 0 && R > 1 ? &ahead : nullptr;  // as scores_tiled: a decode row's pass is its own stream
    int64_t most = 0;
    for (int r = 0; r < rg; ++r) {
      most = std::max(most, n[r0 + r]);
      qr[r] = &held[r0 + r]; sr[r] = s + (r0 + r) * ss; mr[r] = mx + 16 * (r0 + r);
    }
    const int64_t tiles = (most + 15) / 16;
    switch (rg) {
      case 1: q8tiles_rows<D, 1>(qr, kt, tiles, scale, n + r0, sr, mr, first); break;
      case 2: q8tiles_rows<D, 2>(qr, kt, tiles, scale, n + r0, sr, mr, first); break;
      case 3: q8tiles_rows<D, 3>(qr, kt, tiles, scale, n + r0, sr, mr, first); break;
      case 4: q8tiles_rows<D, 4>(qr, kt, tiles, scale, n + r0, sr, mr, first); break;
      case 5: q8tiles_rows<D, 5>(qr, kt, tiles, scale, n + r0, sr, mr, first); break;
      default: q8tiles_rows<D, 6>(qr, kt, tiles, scale, n + r0, sr, mr, first); break;
    }
  }
  weigh_values<D, true, at::Half>(o, n, R, vt, s, ss, mx, acc);
}
