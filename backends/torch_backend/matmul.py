"""x @ W^T for W presented as an [in, out] matrix, in whichever memory layout multiplies fastest for its dtype:
- float32: contiguous [in, out]. MKL multiplies a 16-row block by a pre-transposed weight ~4x faster
  than F.linear does with the [out, in] layout (on an AVX2 EPYC).
- bfloat16 on the CPU: the transposed view of a contiguous [out, in] weight, multiplied as (W @ x^T)^T.
  That operand order reaches oneDNN's AMX/AVX512-BF16 GEMM; x @ W_t and F.linear take slower paths
  (lm_head at 16 rows on a Sapphire Rapids core: 3.8 ms vs 7-12 ms; float32 38 ms). One row is padded to
  two, since a single row falls to a GEMV that is no faster than float32.
A matrix may also be a multiplier chosen by the weight plan (plan.py): packed for the float32 GEMM
(gemm.Packed) or GGUF blocks (quant.Quantized), called like `x @ W_t`."""

from __future__ import annotations

import torch


def row_major(device, dtype: torch.dtype) -> bool:
    """Whether weights of this dtype are kept [out, in] in memory (see the module docstring)."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16


def orient(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] weight as the [in, out] matrix `linear` takes, in the layout that is fastest for it."""
    return weight.contiguous().t() if row_major(weight.device, weight.dtype) else weight.t().contiguous()


def linear(x: torch.Tensor, weight_t, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T for W presented as [in, out]: a tensor (contiguous, or the transposed view of a row-major W),
    or a plan's multiplier (callable like `x @ W_t`)."""
    if callable(weight_t):
        y = weight_t(x)
    else:
        y = x @ weight_t if weight_t.stride(-1) == 1 else rows_times(x, weight_t.t())
    return y if bias is None else y + bias


def rows_times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T computed as (w @ x^T)^T for a contiguous w [out, in]; rows are computed independently
    (identical results for a row alone or in a block), so decode and verify agree exactly."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, flat])  # one row would take the slow GEMV path
    y = (w @ flat.t()).t()[:rows].contiguous()
    return y.view(*x.shape[:-1], w.shape[0])
