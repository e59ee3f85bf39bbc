"""A float32 GEMM for the shapes of decoding: a few rows (1 to ~16) times a weight that streams from memory.

Why not torch's matmul: for M = 16 rows MKL's sgemm reaches ~20-30% of the AVX-512 peak (its pre-packed
variant is ~1.5x faster, which points at per-call packing of the weight, but its packed copy is ~5x the
weight's size); a verify of 16 tokens then costs ~2.5 decode steps where the hardware allows ~1. Here the weight is packed once at load
into tiles of NB columns ([N/NB][K][NB], each tile a contiguous stream) and each tile is multiplied by up
to R rows held in vector registers (AVX-512: R=8 rows x 48 columns = 24 zmm accumulators; AVX2: R=4 x 24).

Every output is summed in the same order whatever M is (a row gives bitwise the same result in any
block of 2 or more rows), in float32 chunks of 32 terms added in float64: more accurate than MKL's sgemm.
One row (a decode step) goes to MKL's GEMV instead, which streams a single row ~1.5x faster than these
tiles on one core; a decode row's result is then exactly torch's matmul.
The C++ is kernels/gemm.cpp (torch.ops.hetero_sd_gemm), built once by kernels.ops."""

from __future__ import annotations


import torch

from .cpu import pick_isa
from .kernels import KernelUnavailable, ops  # noqa: F401  (KernelUnavailable: re-exported)



MAX_ROWS = 64  # verify-sized blocks; longer (prefill) is a large GEMM, where MKL is at its best


def isa(flags: frozenset[str] | None = None) -> str | None:
    """Which tile kernel a CPU with these flags (default: this one's) runs: 'avx512', 'avx2', or None (no
    kernel: torch's matmul)."""
    return pick_isa({"avx512f"}, {"avx2", "fma"}, None, flags)


def extension():
    """The compiled ops, or KernelUnavailable with the reason (announced by the caller)."""
    return ops("gemm", isa() is not None, "this CPU has neither AVX-512 nor AVX2+FMA")


class Packed:
    """A float32 weight [in, out] packed for `gemm`; called like `x @ weight_t`."""

    def __init__(self, weight_t: torch.Tensor, isa_name: str | None = None):
        self.ext, self.avx512 = extension(), (isa_name or isa()) == "avx512"
        self.k, self.n = weight_t.shape
        self.weight_t = weight_t
        self.source = self.identity(weight_t)
        self.tiles = self.ext.pack(weight_t.contiguous(), 48 if self.avx512 else 24)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k)
        if not 1 < flat.shape[0] <= MAX_ROWS:  # a decode step (one row) or a prefill: MKL is as fast or faster
            return x @ self.weight_t
        rows = flat if flat.is_contiguous() else flat.contiguous()
        y = self.ext.gemm.default(rows, self.tiles, self.n, self.avx512)
        return y.view(*x.shape[:-1], self.n) if y.is_contiguous() else y.reshape(*x.shape[:-1], self.n)

    @staticmethod
    def identity(t: torch.Tensor) -> tuple:
        """Which memory a weight is (to share one packing between the target and the draft)."""
        return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes
