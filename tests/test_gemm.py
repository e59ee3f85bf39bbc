"""The float32 decoding GEMM (backends/torch_backend/gemm.py): correct, at least as accurate as torch's
matmul against float64, the same result for a row in any block of 2+ rows, MKL for 1 row and for long
prefills; an unavailable kernel is announced, never silent."""

from __future__ import annotations

import pytest
import torch

from hetero_sd.backends.torch_backend import gemm
from hetero_sd.backends.torch_backend.kernels import KernelUnavailable
from hetero_sd.backends.torch_backend.layers import KERNEL_NOTE, multiplier

pytestmark = pytest.mark.skipif(gemm.isa() is None, reason="no AVX2/AVX-512 on this CPU")


@pytest.mark.parametrize("k,n", [(576, 960), (64, 100), (1536, 50)])
def test_kernel_matches_float64_better_than_torch(k, n):
    torch.manual_seed(1)
    w, x = torch.randn(k, n), torch.randn(16, k) * 3
    packed = gemm.Packed(w)
    exact = x.double() @ w.double()
    ours = (packed(x).double() - exact).abs().max()
    assert ours < 1e-3 and ours <= (x @ w).double().sub(exact).abs().max() * 1.01


def test_rows_do_not_depend_on_the_block():
    w, x = torch.randn(576, 480), torch.randn(16, 576)
    packed = gemm.Packed(w)
    full = packed(x)
    for size in (2, 3, 5, 8, 9, 13):
        assert torch.equal(packed(x[:size]), full[:size])
    assert torch.equal(packed(x[3:5]), full[3:5])
    assert torch.equal(packed(x[:1]), x[:1] @ w)  # one row: MKL's GEMV (decode), torch's own result
    long = torch.randn(gemm.MAX_ROWS + 1, 576)
    assert torch.equal(packed(long), long @ w)  # a prefill: MKL


def test_shapes_are_kept():
    w = torch.randn(64, 30)
    assert gemm.Packed(w)(torch.randn(1, 5, 64)).shape == (1, 5, 30)


def test_unavailable_kernel_is_announced(monkeypatch):
    def missing():
        raise KernelUnavailable("gemm.cpp did not build: no compiler here")

    monkeypatch.setattr(gemm, "extension", missing)
    notes: list[str] = []
    w = torch.randn(64, 30)
    assert multiplier(w, notes) is w and multiplier(w, notes) is w  # torch's matmul on the tensor
    assert len(notes) == 1 and notes[0].startswith(KERNEL_NOTE) and "no compiler here" in notes[0]
