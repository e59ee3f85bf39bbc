// Issue 26: how many AVX2 integer multiplies (vpmaddubsw, vpmaddwd) this core issues per second, against an
// add (vpaddw) and a shift: 8 independent chains per loop, so latency does not bind. The int8-row kernel
// (backends/torch_backend/kernels/quant8.cpp) spends 3 multiplies per 64 Q4_1 products, so this rate x 64/3
// is what its multiplies would allow per core.
//   g++ -O2 benchmarks/port_probe.cpp -o /tmp/port_probe && /tmp/port_probe
#include <immintrin.h>
#include <chrono>
#include <cstdio>

template <int op>
__attribute__((target("avx2"), noinline)) static double rate(long n) {
  __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(2), a2 = _mm256_set1_epi8(3), a3 = _mm256_set1_epi8(4),
          a4 = _mm256_set1_epi8(5), a5 = _mm256_set1_epi8(6), a6 = _mm256_set1_epi8(7), a7 = _mm256_set1_epi8(8);
  const __m256i b = _mm256_set1_epi8(3);
  auto began = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#define STEP(a) a = op == 0 ? _mm256_maddubs_epi16(a, b) : op == 1 ? _mm256_madd_epi16(a, b) : op == 2 ? _mm256_add_epi16(a, b) : _mm256_srai_epi32(a, 3);
    STEP(a0) STEP(a1) STEP(a2) STEP(a3) STEP(a4) STEP(a5) STEP(a6) STEP(a7)
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7));
  }
  return 8.0 * n / std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() / 1e9;
}

int main() {
  const long n = 100000000;
  for (int round = 0; round < 2; ++round)
    std::printf("G instructions/s, one core: vpmaddubsw %.2f  vpmaddwd %.2f  vpaddw %.2f  vpsrad %.2f\n",
                rate<0>(n), rate<1>(n), rate<2>(n), rate<3>(n));
}
