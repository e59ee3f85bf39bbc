#include <ATen/ATen.h>
#include <torch/library.h>
#include <vector>
#include <memory>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sys/syscall.h>
#include <unistd.h>

// int8 codes per block of 32, as llama.cpp's quantize_row_q8_1: d = amax/127, q = x*(1/d) rounded to
// nearest even (the vector conversion's rounding; the same on both ISAs), and the block's code sum
__attribute__((target("avx2"))) static void codes256(const float* v, float id, int32_t* c) {
  for (int h = 0; h < 32; h += 8)
    _mm256_storeu_si256((__m256i*)(c + h), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + h), _mm256_set1_ps(id))));
}

static void quantize_block(const float* v, int8_t* q, float* dx, float* ms, int32_t* sq) {  // AVX2
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  int32_t c[32];
  codes256(v, id, c);
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) { q[i] = (int8_t)c[i]; s += c[i]; }
  *dx = d; *sq = s; *ms = d * (float)s;
}

// the same numbers, vectorized throughout: a max and integer sums do not depend on their order
__attribute__((target("avx512f,avx512bw"))) static void quantize_block512(const float* v, int8_t* q, float* dx, float* ms,
                                                                        int32_t* sq) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m512i ca = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i cb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(ca));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(cb));
  const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb));
  *dx = d; *sq = s; *ms = d * (float)s;
}

static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, float* ms, int32_t* sq, bool avx512) {
  const int64_t KB = K / 32;
  at::parallel_for(0, M * KB, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t at = (i / KB) * K + (i % KB) * 32;
      (avx512 ? quantize_block512 : quantize_block)(x + at, q + at, dx + i, ms + i, sq + i);
    }
  });
}

struct Rows { const int8_t* q; const float* dx; const float* ms; const int32_t* sq; int64_t K, KB; };

template <int R, bool Q41>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) static void tile512(Rows x, const uint8_t* w, float* y, int64_t ldy) {
  constexpr int NB = 16, BB = (Q41 ? 20 : 34) * NB, HEAD = (Q41 ? 4 : 2) * NB;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < x.KB; ++b) {
    const uint8_t* blk = w + b * BB;
    // Non-temporal: the weights stream through once per forward (96 MB against a 32 MB L3); a T0 prefetch would put
    // them in L2 and, evicted, in the L3, pushing out what the next calls read again (the draft, the rows): on the
    // 2-core Zen 5, decode 0.86-0.97x and verify-8 0.75-0.93x the time. (The AVX2 tiles keep T0: there NTA was slower.)
    // 24 blocks ahead (7.7 KB of Q4_1): a non-temporal line waits in an L1 miss buffer, so how far ahead the stream
    // is requested bounds how fast one core reads it (verify-8 0.97x the time of 12 blocks ahead).
    for (int l = 0; l < BB; l += 64) _mm_prefetch((const char*)(blk + 24 * BB + l), _MM_HINT_NTA);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    for (int g = 0; g < (Q41 ? 4 : 8); ++g) {
      __m512i wv = _mm512_loadu_si512((const void*)(blk + HEAD + g * 64));
      if (Q41) {
        __m512i lo = _mm512_and_si512(wv, low), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q + r * x.K + b * 32;
          s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(*(const int32_t*)(q + 4 * g)));
          s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(*(const int32_t*)(q + 16 + 4 * g)));
        }
      } else {
        for (int r = 0; r < R; ++r)
          s[r] = _mm512_dpbusd_epi32(s[r], wv, _mm512_set1_epi32(*(const int32_t*)(x.q + r * x.K + b * 32 + 4 * g)));
      }
    }
    const __m512 m = Q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 2 * NB))) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      int64_t i = r * x.KB + b;
      if (!Q41) s[r] = _mm512_sub_epi32(s[r], _mm512_set1_epi32(128 * x.sq[i]));  // the +128 of the stored bytes
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(x.dx[i])), acc[r]);
      if (Q41) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.ms[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// AVX2 (vpmaddubsw + vpmaddwd). Q4_1: up to 4 rows per loaded tile, accumulators in registers. Q8_0 (the head,
// the largest matrix): up to 8 rows, their float accumulators in memory (8 rows of int32 sums fill the
// registers). Q4_1 takes 3 multiplies per 64 products: the multiply ports are not what bounds these tiles.
// The epilogue is once per block and row, the same two fmadds in the same order whatever R: a row's bits do not
// depend on the rows beside it.
template <int R, bool Q41>
__attribute__((target("avx2,fma,f16c"))) static void tile256(Rows x, const uint8_t* w, float* y, int64_t ldy) {
  constexpr int NB = 8, BB = (Q41 ? 20 : 34) * NB, HEAD = (Q41 ? 4 : 2) * NB;
  constexpr bool MEM = R > 4;  // accumulators in memory
  alignas(32) float accm[MEM ? R : 1][NB];
  __m256 acc[MEM ? 1 : R];
  for (int r = 0; r < R; ++r) {
    if (MEM) _mm256_store_ps(accm[r], _mm256_setzero_ps()); else acc[r] = _mm256_setzero_ps();
  }
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < x.KB; ++b) {
    const uint8_t* blk = w + b * BB;
    for (int l = 0; l < BB; l += 64) _mm_prefetch((const char*)(blk + 12 * BB + l), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    for (int g = 0; g < (Q41 ? 4 : 8); ++g) {
      __m256i wv = _mm256_loadu_si256((const __m256i*)(blk + HEAD + g * 32));
      if (Q41) {
        __m256i lo = _mm256_and_si256(wv, low), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q + r * x.K + b * 32;
          __m256i a = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(*(const int32_t*)(q + 4 * g)));
          __m256i c = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(*(const int32_t*)(q + 16 + 4 * g)));
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_add_epi16(a, c), ones));  // |a+c| <= 4*15*127
        }
      } else {  // stored as |q| (unsigned) with the sign moved onto x: vpmaddubsw then cannot saturate
        __m256i mag = _mm256_abs_epi8(wv);
        for (int r = 0; r < R; ++r) {
          __m256i xv = _mm256_set1_epi32(*(const int32_t*)(x.q + r * x.K + b * 32 + 4 * g));
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(xv, wv)), ones));
        }
      }
    }
    const __m256 m = Q41 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 2 * NB))) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      int64_t i = r * x.KB + b;
      __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.dx[i])),
                                 MEM ? _mm256_load_ps(accm[r]) : acc[r]);
      if (Q41) a = _mm256_fmadd_ps(m, _mm256_set1_ps(x.ms[i]), a);
      if (MEM) _mm256_store_ps(accm[r], a); else acc[r] = a;
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, MEM ? _mm256_load_ps(accm[r]) : acc[r]);
}


// ---- AMX-INT8 (Sapphire Rapids and later): one tile product per block of 32 inputs and 16 columns, for
// up to 16 rows at once. The tile's int32 sums are exactly vpdpbusd's, and the float epilogue is
// tile512's, so a row's result is bitwise the same on either path: AMX serves verify blocks, VNNI decode.
struct TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static bool amx_ready() {  // Linux hands out the AMX tile state only on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// up to 4 blocks in flight: C tiles 0-3, A tiles 4/5 and B tiles 6/7 alternate, so that loads overlap products
#define AMX_BLOCK(j, A, B)                                                                                  \
  if (j < nb) {                                                                                             \
    const uint8_t* blk = wt + (b + j) * BB;                                                                 \
    const uint8_t* bsrc = blk + HEAD;                                                                       \
    if (Q41) {                                                                                              \
      for (int g = 0; g < 4; ++g) {                                                                         \
        __m512i wv = _mm512_loadu_si512((const void*)(blk + HEAD + g * 64));                                \
        _mm512_store_si512((void*)(wb[j] + g * 64), _mm512_and_si512(wv, low));                             \
        _mm512_store_si512((void*)(wb[j] + (4 + g) * 64), _mm512_and_si512(_mm512_srli_epi16(wv, 4), low)); \
      }                                                                                                     \
      bsrc = wb[j];                                                                                         \
    }                                                                                                       \
    _tile_zero(j);                                                                                          \
    _tile_loadd(A, q + r0 * K + (b + j) * 32, K);                                                           \
    _tile_loadd(B, bsrc, 64);                                                                               \
    _tile_dpbsud(j, A, B);                                                                                  \
  }

template <bool Q41>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,amx-tile,amx-int8")))
static void tiles_amx(const int8_t* q, const float* dx, const float* ms, const int32_t* sq, int64_t M, int64_t K,
                      const uint8_t* w, int64_t t0, int64_t t1, int64_t stride, float* y, int64_t ldy) {
  constexpr int NB = 16, BB = (Q41 ? 20 : 34) * NB, HEAD = (Q41 ? 4 : 2) * NB;
  const int64_t KB = K / 32;
  alignas(64) uint8_t wb[4][8 * 64];
  alignas(64) int32_t cb[4][16 * 16];
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int rows = (int)std::min<int64_t>(16, M - r0);
    TileConfig cfg{};
    cfg.palette = 1;
    for (int c = 0; c < 4; ++c) { cfg.rows[c] = rows; cfg.colsb[c] = 64; }  // C: rows x 16 int32
    for (int a = 4; a < 6; ++a) { cfg.rows[a] = rows; cfg.colsb[a] = 32; }  // A: rows x 32 int8 codes
    for (int g = 6; g < 8; ++g) { cfg.rows[g] = 8; cfg.colsb[g] = 64; }     // B: 8 groups of 4 inputs x 16 columns
    _tile_loadconfig(&cfg);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = w + t * stride;
      __m512 acc[16];
      for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < KB; b += 4) {
        const int nb = (int)std::min<int64_t>(4, KB - b);
        for (int l = 0; l < 4 * BB; l += 64) _mm_prefetch((const char*)(wt + (b + 8) * BB + l), _MM_HINT_T0);
        AMX_BLOCK(0, 4, 6) AMX_BLOCK(1, 5, 7) AMX_BLOCK(2, 4, 6) AMX_BLOCK(3, 5, 7)
        _tile_stored(0, cb[0], 64);
        if (nb > 1) _tile_stored(1, cb[1], 64);
        if (nb > 2) _tile_stored(2, cb[2], 64);
        if (nb > 3) _tile_stored(3, cb[3], 64);
        for (int j = 0; j < nb; ++j) {
          const uint8_t* blk = wt + (b + j) * BB;
          const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
          const __m512 m = Q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 2 * NB))) : _mm512_setzero_ps();
          for (int r = 0; r < rows; ++r) {
            int64_t i = (r0 + r) * KB + b + j;
            __m512i sv = _mm512_load_si512((const void*)(cb[j] + r * 16));
            if (!Q41) sv = _mm512_sub_epi32(sv, _mm512_set1_epi32(128 * sq[i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sv), _mm512_mul_ps(d, _mm512_set1_ps(dx[i])), acc[r]);
            if (Q41) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ms[i]), acc[r]);
          }
        }
      }
      for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy + t * NB, acc[r]);
    }
  }
  _tile_release();
}

using Tile = void (*)(Rows, const uint8_t*, float*, int64_t);

template <bool Q41> static Tile pick(bool avx512, int r) {
  if (avx512) switch (r) { case 1: return tile512<1, Q41>; case 2: return tile512<2, Q41>; case 3: return tile512<3, Q41>;
                           case 4: return tile512<4, Q41>; case 5: return tile512<5, Q41>; case 6: return tile512<6, Q41>;
                           case 7: return tile512<7, Q41>; default: return tile512<8, Q41>; }
  if (Q41 && r > 4) r = 4;  // (qgemm8 gives Q4_1 at most 4 rows here)
  switch (r) { case 1: return tile256<1, Q41>; case 2: return tile256<2, Q41>; case 3: return tile256<3, Q41>;
               case 4: return tile256<4, Q41>; case 5: return tile256<5, Q41>; case 6: return tile256<6, Q41>;
               case 7: return tile256<7, Q41>; default: return tile256<8, Q41>; }
}

struct Codes {  // int8 codes of M rows of K inputs, and per block of 32 their scale, scale x code sum, code sum
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> dx, ms;
  std::unique_ptr<int32_t[]> sq;
  int64_t qn = 0, bn = 0;
  void fit(int64_t codes, int64_t blocks) {
    if (codes > qn) { q.reset(new int8_t[codes]); qn = codes; }
    if (blocks > bn) { dx.reset(new float[blocks]); ms.reset(new float[blocks]); sq.reset(new int32_t[blocks]); bn = blocks; }
  }
};
constexpr int64_t kKeep = 1 << 20;  // bytes of codes a thread keeps between calls (64 rows of 16k inputs)
static Codes& kept_codes() { static thread_local Codes codes; return codes; }

// Threads take fixed halves of the tiles: each streams its own range front to back, the order its prefetch
// follows (work claimed as threads come free was slower on the 2-core Zen 5: decode and verify 1.03-1.16x the time).
// x [M, K] float32 -> y [M, tiles*NB]; packed [tiles][K/32][block bytes x NB]
// x [..., K] float32 (made contiguous here) -> y [..., n], the shapes handled here as quant.qgemm does
at::Tensor qgemm8(at::Tensor x_in, at::Tensor packed, bool q41, bool avx512, int64_t amx_rows, int64_t n) {
  auto x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "qgemm8: float32 rows");
  int64_t K = x.size(-1), M = x.numel() / K, tiles = packed.size(0), KB = packed.size(1), nb = avx512 ? 16 : 8;
  TORCH_CHECK(KB * 32 == K && packed.size(2) == (q41 ? 20 : 34) * nb && n <= tiles * nb && n > (tiles - 1) * nb,
              "qgemm8: packed weight does not fit x or this ISA");
  // the rows' int8 codes, scales, mins and code sums: the calling thread's own buffers, kept between calls and
  // never zeroed (every byte is written before it is read). Four vectors a call were ~480 allocations and
  // ~500 KB of zeroing a verify, on the calling thread alone while the other waited. A prompt's rows beyond
  // kKeep bytes get buffers of their own.
  Codes held;
  Codes& codes = M * K <= kKeep ? kept_codes() : held;
  codes.fit(M * K, M * KB);
  const Rows all{codes.q.get(), codes.dx.get(), codes.ms.get(), codes.sq.get(), K, KB};
  quantize_rows(x.data_ptr<float>(), M, K, codes.q.get(), codes.dx.get(), codes.ms.get(), codes.sq.get(), avx512);
  auto y = at::empty({M, tiles * nb}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>(); float* yp = y.data_ptr<float>();
  int64_t ldy = tiles * nb, rows_max = avx512 || !q41 ? 8 : 4, stride = packed.size(1) * packed.size(2);
  if (avx512 && amx_rows > 0 && M >= amx_rows && amx_ready()) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      (q41 ? tiles_amx<true> : tiles_amx<false>)(all.q, all.dx, all.ms, all.sq, M, K, wp, begin, end,
                                                stride, yp, ldy);
    });
  } else {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t r0 = 0; r0 < M; r0 += rows_max) {
          int r = (int)std::min(rows_max, M - r0);
          Rows rows{all.q + r0 * K, all.dx + r0 * KB, all.ms + r0 * KB, all.sq + r0 * KB, K, KB};
          (q41 ? pick<true>(avx512, r) : pick<false>(avx512, r))(rows, wp + t * stride, yp + r0 * ldy + t * nb, ldy);
        }
    });
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return n == ldy ? y.view(sizes) : y.narrow(1, 0, n).reshape(sizes);
}

TORCH_LIBRARY(hetero_sd_quant8, m) {  // torch.ops.hetero_sd_quant8.*: the dispatcher releases the GIL around a call
  m.def("qgemm8(Tensor x, Tensor packed, bool q41, bool avx512, int amx_rows, int n) -> Tensor");
  m.def("amx_ready() -> bool", &amx_ready);
}
TORCH_LIBRARY_IMPL(hetero_sd_quant8, CPU, m) {
  m.impl("qgemm8", &qgemm8);
}
