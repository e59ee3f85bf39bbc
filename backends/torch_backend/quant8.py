"""x @ W^T with W as GGUF Q4_1 / Q8_0 blocks and x quantized to int8 per block of 32 (llama.cpp's Q8_1):
integer dot products (AVX512-VNNI vpdpbusd, or AVX2 vpmaddubsw) instead of dequantizing every weight to
float32. A DIFFERENT TARGET from the float32 one (quant.py): x is rounded to 8 bits, so logits move by
~1e-2, not 1e-4; it runs only on request (`--dtype int8`), and its baseline runs the same numerics.

Why it is still a deterministic function of each row (what lossless needs): a row's int8 codes, scale
and code sum come from that row alone; integer sums are exact in any order; the float epilogue per block
and output lane is the same three operations whatever the number of rows or the ISA:
    y += float(sum q_w*q_x) * (d_w * d_x)  [+ m_w * (d_x * sum q_x) for Q4_1]
so a row gives bitwise the same result alone, in a verify block, with AVX-512 or AVX2, and through AMX
tiles (Sapphire Rapids and later: verify blocks of >= 12 rows; the tile's int32 sums are vpdpbusd's).

Layout (packed once at load): output columns in tiles of NB (AVX-512: 16, AVX2: 8); per tile and block,
NB fp16 scales (and NB fp16 mins for Q4_1), then groups of NB x 4 bytes: column j's 4 consecutive bytes,
so that one 32-bit lane holds 4 inputs of one column, which is what vpdpbusd / vpmaddubsw+vpmaddwd sum.
Q4_1 byte p holds inputs p (low nibble) and p+16 (high); Q8_0 bytes are stored +128 (unsigned for
vpdpbusd; the kernel subtracts 128 * sum q_x) or, on AVX2, as |q| with the sign moved onto x
(vpmaddubsw saturates at 2^15: 255*127*2 would not fit, 127*127*2 does)."""

from __future__ import annotations

import torch

from .cpu import cpu_flags, pick_isa
from .kernels import ops
from .quant import Q4_1, Quantized
from .quant import extension as quant_extension


def isa(prefer: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """'avx512' (with BW and VNNI), 'avx2' (with FMA and F16C), or None, for a CPU with these flags (default:
    this one's). prefer='avx2': the AVX2 kernel on an AVX-512 CPU, the code an AVX2-only CPU runs (the tests run both)."""
    return pick_isa({"avx512f", "avx512bw", "avx512_vnni", "f16c"}, {"avx2", "fma", "f16c"}, prefer, flags)


def amx_rows(forced: int | None = None, flags: frozenset[str] | None = None) -> int:
    """From how many rows the AMX tiles take over from VNNI (0: never): `forced` (the tests compare both paths),
    else 12 where the CPU has AMX-INT8: at 16 rows the Q8_0 head takes 1.04 ms instead of 1.50 on a Sapphire Rapids
    Xeon; at 8 rows and fewer AMX loses (per block it stores the tile and scales every row)."""
    if forced is not None:
        return forced
    return 12 if {"amx_tile", "amx_int8"} <= (cpu_flags() if flags is None else flags) else 0


def extension():
    return ops("quant8", isa() is not None, "this CPU has neither AVX512-VNNI nor AVX2+FMA+F16C")


def how(isa_name: str | None) -> str:
    """How these blocks multiply, in a note."""
    return (f"times rows quantized to int8 per 32 inputs (llama.cpp's Q8_1), in integer dot products ({isa_name} "
            "kernel): a different target from the float32 one")


class Int8Blocks(Quantized):
    """A weight [in, out] as GGUF blocks, multiplied with int8-quantized rows of x (any number of rows: decode,
    verify and prefill; `fallback`, the float32 weight, serves only other dtypes)."""

    def __init__(self, kind: str, rows, fallback, weight_t: torch.Tensor | None = None, isa_name: str | None = None,
                 amx: int | None = None):
        self.amx_forced = amx
        super().__init__(kind, rows, fallback, weight_t, isa_name or isa())

    def setup(self, rows: torch.Tensor, weight_t: torch.Tensor | None) -> None:
        """(weight_t is not checked: these numerics are not the float32 weights' anyway.)"""
        self.ext, self.avx512 = extension(), self.isa == "avx512"
        # 4 bytes per column and lane; Q8_0 +128 for vpdpbusd, signed for AVX2's |q| and sign (quant.pack)
        self.packed = quant_extension().pack(rows, self.kind == Q4_1, 16 if self.avx512 else 8, 4, self.avx512)
        self.amx_rows = amx_rows(self.amx_forced) if self.avx512 else 0

    suffix = " x int8 rows"

    def takes(self, x: torch.Tensor) -> bool:
        """Every number of rows, prefill included (llama.cpp quantizes its prompt's rows too, and on AVX2 the
        int8 kernel at 256 rows takes about half the time of torch's float32 matmul): the prompt's KV entries then
        have the decode rows' numerics."""
        return x.dtype == torch.float32 and x.numel() >= self.k

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.ext.qgemm8.default(x, self.packed, self.kind == Q4_1, self.avx512, self.amx_rows, self.n)


def peak_probe(matrices, rows: int = 16):
    """(a call, its multiply-add ops: 2 per product) for the practical peak of the int8-row kernel: `rows` rows
    by the largest Int8Blocks among `matrices` (a layer's matrix, ~1-2 MB: in cache after the first call), the
    analog of a dense matmul's peak for a model that never runs one (bench --costs times it). None without one."""
    ours = [m for m in matrices if isinstance(m, Int8Blocks)]
    if not ours:
        return None
    m = max(ours, key=lambda q: q.n * q.k if q.n * q.k <= 4 * 2**20 else 0)  # a layer's, not a 49k-row head
    x = torch.randn(rows, m.k)
    return (lambda: m(x)), 2 * rows * m.n * m.k
