"""A float32 GEMM for the shapes of decoding: a few rows (1 to ~16) times a weight that streams from memory.

Why not torch's matmul: for M = 16 rows MKL's sgemm reaches ~20-30% of the AVX-512 peak (its pre-packed
variant is ~1.5x faster, which points at per-call packing of the weight, but its packed copy is ~5x the
weight's size); a verify of 16 tokens then costs ~2.5 decode steps where the hardware allows ~1. Here the weight is packed once at load
into tiles of NB columns ([N/NB][K][NB], each tile a contiguous stream) and each tile is multiplied by up
to R rows held in vector registers (AVX-512: R=8 rows x 48 columns = 24 zmm accumulators; AVX2: R=4 x 24).

Every output is summed in the same order whatever M is (a row gives bitwise the same result in any
block of 2 or more rows), in float32 chunks of 32 terms added in float64: more accurate than MKL's sgemm.
One row (a decode step) goes to MKL's GEMV instead, which streams a single row ~1.5x faster than these
tiles on one core; decode results are then exactly those of the previous code (torch's matmul).
The C++ is compiled once by torch.utils.cpp_extension into its cache (~/.cache/torch_extensions) and
reused by every later run."""

from __future__ import annotations

import functools
import os
import shutil
import sys

import torch

from .cpu import cpu_flags

SOURCE = r"""
#include <torch/extension.h>
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
torch::Tensor pack(torch::Tensor w, int64_t nb) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat, "pack: a float32 matrix");
  int64_t K = w.size(0), N = w.size(1), tiles = (N + nb - 1) / nb;
  auto padded = torch::zeros({K, tiles * nb}, w.options());
  padded.narrow(1, 0, N).copy_(w);
  return padded.view({K, tiles, nb}).permute({1, 0, 2}).contiguous();
}

// x [M, K] contiguous float32, packed [tiles][K][nb] -> y [M, n]
torch::Tensor gemm(torch::Tensor x, torch::Tensor packed, int64_t n, bool avx512) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat && x.dim() == 2, "gemm: contiguous float32 rows");
  int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), nb = packed.size(2);
  TORCH_CHECK(packed.size(1) == K && nb == (avx512 ? 48 : 24), "gemm: packed weight does not fit");
  auto y = torch::empty({M, tiles * nb}, x.options());
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // kernels release the GIL: the other lane's thread runs meanwhile
  m.def("pack", &pack);
  m.def("gemm", &gemm, py::call_guard<py::gil_scoped_release>());
}
"""


MAX_ROWS = 64  # verify-sized blocks; longer (prefill) is a large GEMM, where MKL is at its best


class KernelUnavailable(RuntimeError):
    pass


def isa() -> str | None:
    """Which tile kernel this CPU runs: 'avx512', 'avx2', or None (no kernel: torch's matmul)."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


@functools.cache
def extension():
    """The compiled kernel module; raises KernelUnavailable with the reason (announced by the caller)."""
    if os.environ.get("HETERO_SD_GEMM", "kernel") == "torch":
        raise KernelUnavailable("HETERO_SD_GEMM=torch")
    if isa() is None:
        raise KernelUnavailable("this CPU has neither AVX-512 nor AVX2+FMA")
    return build("hetero_sd_gemm", SOURCE)


def build(prefix: str, source: str):
    """Compile a C++ kernel module once per Python environment and torch, and load it; KernelUnavailable
    with the reason. One build folder per environment: two venvs sharing ~/.cache/torch_extensions under
    one name rebuild it for each other (their include paths differ) and wait on each other's build lock,
    which stalled a generation for minutes when another checkout's tests ran."""
    import hashlib
    ninja_on_path()
    key = f"{sys.prefix}|{torch.__version__}|{source}".encode()
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline(f"{prefix}_{hashlib.sha1(key).hexdigest()[:10]}", cpp_sources=source,
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # a compiler or header problem: the caller announces it
        raise KernelUnavailable(f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}") from e


def ninja_on_path() -> None:
    """torch builds extensions with the `ninja` binary found on PATH. The `ninja` package installs it
    beside this interpreter, which is not on PATH when a venv is used without being activated."""
    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


class Packed:
    """A float32 weight [in, out] packed for `gemm`; called like `x @ weight_t`."""

    def __init__(self, weight_t: torch.Tensor):
        self.ext, self.avx512 = extension(), isa() == "avx512"
        self.k, self.n = weight_t.shape
        self.weight_t = weight_t
        self.source = self.identity(weight_t)
        self.tiles = self.ext.pack(weight_t.contiguous(), 48 if self.avx512 else 24)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k)
        if not 1 < flat.shape[0] <= MAX_ROWS:  # a decode step (one row) or a prefill: MKL is as fast or faster
            return x @ self.weight_t
        rows = flat if flat.is_contiguous() else flat.contiguous()
        if torch.autograd._profiler_enabled():  # a pybind call is no aten op: name it for torch.profiler
            with torch.profiler.record_function("hetero_sd::gemm"):
                y = self.ext.gemm(rows, self.tiles, self.n, self.avx512)
        else:
            y = self.ext.gemm(rows, self.tiles, self.n, self.avx512)
        return y.view(*x.shape[:-1], self.n) if y.is_contiguous() else y.reshape(*x.shape[:-1], self.n)

    @staticmethod
    def identity(t: torch.Tensor) -> tuple:
        """Which memory a weight is (to share one packing between the target and the draft)."""
        return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes
