"""x @ W^T with W kept as GGUF Q4_1 / Q8_0 blocks: the decode and verify steps of a target that came from
a GGUF read ~5.6x fewer bytes per token than its float32 copy, for the same function up to float32 rounding.

Why it is the same function: the converted float32 target (hetero_sd/default_model.py) holds exactly the
dequantized values, d*q + m (Q4_1) and d*q (Q8_0), computed in float32 (`Quantized` checks at load that
the blocks dequantize bitwise to the float32 weights they stand for, and refuses otherwise). Per block of
32 inputs the kernel computes x . (d*q + m) regrouped as d * (x . (q - 8)) + (m + 8d) * sum(x): the same
d, q and m, no weight dequantized (that saves 2 of 9 vector ops per 32 weights, and a decode step is bound
by those ops, not by memory: benchmarks/README.md). Centred on q = 8 because a Q4_1 block's m is about -8d:
d * (x . q) and m * sum(x) then cancel, and their rounding showed in the parity test against float64
(2-3e-4 over its tolerance; centred, within it). Only float32 rounding differs from torch's matmul of the
dequantized weights, within what the parity tests' 1e-4 allows.

Layout (packed once at load): output columns in tiles of NB (AVX-512: 16, one zmm; AVX2: 8, one ymm); per
tile, per block of 32 inputs, NB fp16 scales (and NB fp16 mins for Q4_1) then the block's bytes transposed
so that one load gives byte p of NB rows (Q4_1: 16 bytes of nibble pairs; Q8_0: 32 int8). Each tile is a
contiguous stream, one lane per output column: no horizontal sums. R rows of x (AVX-512: up to 8; AVX2: 4)
share each loaded vector. Every output lane is summed in the same order whatever M is (per block two
float32 chains, low/high nibble or even/odd input, added at the end of the block), and AVX2 performs the
same per-lane operations as AVX-512: a row gives bitwise the same result alone, in any block of rows, on
either ISA.

Parallel over tiles with at::parallel_for (OpenMP). M = 1..MAX_ROWS rows; longer (prefill) goes to the
float32 fallback. The C++ is kernels/quant.cpp (torch.ops.hetero_sd_quant)."""

from __future__ import annotations


import numpy as np
import torch

from hetero_sd.models.gguf_layout import BLOCK_BYTES, Q4_1, Q8_0, dequantize, gguf_rows, gguf_tensors  # noqa: F401

from .cpu import pick_isa
from .kernels import KernelUnavailable, ops


MAX_ROWS = 64  # decode (1), verify (2..16), the draft's head; longer (prefill) multiplies the float32 weights
WEIGHTS = "Q4_1/Q8_0 blocks from the GGUF"  # how stats and bench name the quantized target's weights
NOTE = "target weights"


def isa(prefer: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """'avx512', 'avx2' (with FMA and F16C), or None, for a CPU with these flags (default: this one's).
    prefer='avx2': the AVX2 kernel on an AVX-512 CPU, the code an AVX2-only CPU runs (the tests run both)."""
    return pick_isa({"avx512f"}, {"avx2", "fma", "f16c"}, prefer, flags)


def extension():
    """The compiled ops (built once: kernels.ops); KernelUnavailable with the reason, which the caller announces."""
    return ops("quant", isa() is not None, "this CPU has neither AVX-512 nor AVX2+FMA+F16C")


def how(isa_name: str | None) -> str:
    """How these blocks multiply, in a note."""
    return f"times bitwise the float32 weights' d, q and m, never dequantized ({isa_name} kernel)"


class Quantized:
    """A weight [in, out] kept as GGUF blocks, called like `x @ weight_t` for 1..MAX_ROWS rows; longer
    inputs go to `fallback` (the float32 weight [in, out] or its gemm.Packed)."""

    blocks = True  # (a multiplier of GGUF blocks: its rows go in as float32, whatever the caller's dtype)

    def __init__(self, kind: str, rows: np.ndarray, fallback, weight_t: torch.Tensor | None = None,
                 isa_name: str | None = None):
        if kind not in BLOCK_BYTES:
            raise KernelUnavailable(f"{kind} blocks have no kernel here (only Q4_1 and Q8_0)")
        self.kind, self.fallback, self.isa = kind, fallback, isa_name or isa()
        self.n, self.k = rows.shape[0], rows.shape[1] // BLOCK_BYTES[kind] * 32
        self.setup(torch.from_numpy(np.array(rows)) if isinstance(rows, np.ndarray) else rows.contiguous(), weight_t)

    def setup(self, rows: torch.Tensor, weight_t: torch.Tensor | None) -> None:
        """This kernel's extension, ISA and packed blocks (after checking them against the float32 weights)."""
        self.ext, self.avx512 = extension(), self.isa == "avx512"
        if weight_t is not None and not self.ext.matches(rows, self.kind == Q4_1, weight_t):
            raise ValueError("the GGUF blocks do not dequantize to the float32 weights")
        self.packed = self.ext.pack(rows, self.kind == Q4_1, 16 if self.avx512 else 8, 1, False)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and 1 <= x.numel() // self.k <= MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes(x):
            return self.product(x)
        return self.fallback(x) if callable(self.fallback) else x @ self.fallback  # a prefill: float32 weights

    suffix = ""  # what the weights' name adds: these numerics are the float32 target's

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> [..., n]: the kernel takes the shapes (see qgemm)."""
        return self.ext.qgemm.default(x, self.packed, self.kind == Q4_1, self.avx512, self.n)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes
