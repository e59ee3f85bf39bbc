// Issue 26: the AVX-512 VNNI core's arithmetic rates, against which the int8-row kernel's Q4_1 tile
// (backends/torch_backend/kernels/quant8.cpp, tile512) is read: per block of 32 inputs, row and 16 columns
// it issues 8 vpdpbusd (512 multiply-adds) and an epilogue of vcvtdq2ps, vmulps and 2 vfmadd. Three loops,
// 8 independent chains each (latency does not bind): vpdpbusd alone, vfmadd alone, and the tile's mix.
//   g++ -O2 benchmarks/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak
#include <immintrin.h>
#include <chrono>
#include <cstdio>

template <int op>
__attribute__((target("avx512f,avx512vnni"), noinline)) static double rate(long n) {
  __m512i a0 = _mm512_set1_epi32(1), a1 = _mm512_set1_epi32(2), a2 = _mm512_set1_epi32(3), a3 = _mm512_set1_epi32(4),
          a4 = _mm512_set1_epi32(5), a5 = _mm512_set1_epi32(6), a6 = _mm512_set1_epi32(7), a7 = _mm512_set1_epi32(8);
  __m512 f0 = _mm512_set1_ps(1), f1 = _mm512_set1_ps(2), f2 = _mm512_set1_ps(3), f3 = _mm512_set1_ps(4),
         f4 = _mm512_set1_ps(5), f5 = _mm512_set1_ps(6), f6 = _mm512_set1_ps(7), f7 = _mm512_set1_ps(8);
  const __m512i b = _mm512_set1_epi32(0x01020304), c = _mm512_set1_epi32(0x05060708);
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
  auto began = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#define DP(a) a = _mm512_dpbusd_epi32(a, b, c);
#define FMA(f) f = _mm512_fmadd_ps(f, x, y);
#define EPI(f, a) f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(x, y), f); f = _mm512_fmadd_ps(x, y, f);
#define DP8 DP(a0) DP(a1) DP(a2) DP(a3) DP(a4) DP(a5) DP(a6) DP(a7)
    if (op == 0) { DP8 }
    if (op == 1) { FMA(f0) FMA(f1) FMA(f2) FMA(f3) FMA(f4) FMA(f5) FMA(f6) FMA(f7) }
    if (op == 2) {  // per 8 vpdpbusd one row-block's epilogue, as in tile512; 8 of them rotate (no latency chain)
      DP8 EPI(f0, a0) DP8 EPI(f1, a1) DP8 EPI(f2, a2) DP8 EPI(f3, a3)
      DP8 EPI(f4, a4) DP8 EPI(f5, a5) DP8 EPI(f6, a6) DP8 EPI(f7, a7)
    }
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7));
    __asm__ volatile("" : "+v"(f0), "+v"(f1), "+v"(f2), "+v"(f3), "+v"(f4), "+v"(f5), "+v"(f6), "+v"(f7));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() / n;
}

int main() {
  const long n = 100000000;
  for (int round = 0; round < 2; ++round) {
    const double dp = rate<0>(n), fma = rate<1>(n), mix = rate<2>(n / 8) / 8;
    std::printf("vpdpbusd zmm: %.2f G/s (%.0f G int8 multiply-adds/s)   vfmadd zmm: %.2f G/s   "
                "8 vpdpbusd + epilogue: %.2f ns (%.0f G int8 multiply-adds/s, %.0f%% of vpdpbusd alone)\n",
                8 / dp / 1e9, 8 * 64 / dp / 1e9, 8 / fma / 1e9, mix * 1e9, 512 / mix / 1e9, 100 * dp / mix);
  }
}
