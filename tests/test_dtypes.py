"""Reduced-precision paths: the bf16 weight layout and its row-invariance, the bf16 draft default on CPUs
with native bf16 (lossless: the draft's numerics never reach the output), and the bf16 target's parity
with the float32 one at a stated tolerance (a different target, never the default)."""

from __future__ import annotations

import pytest
import torch

import hetero_sd.backends.torch_backend as tb
from hetero_sd.backends.torch_backend import cpu
from hetero_sd.backends.torch_backend.layers import linear, orient
from hetero_sd.runtime import load

from .conftest import make_tiny_target


def test_bf16_weights_multiply_as_float32_does_and_rows_are_independent():
    w = torch.randn(300, 64)
    x = torch.randn(1, 7, 64)
    wb = orient(w.bfloat16())
    assert wb.shape == (64, 300) and wb.stride(-1) != 1  # the transposed view of a row-major weight
    y = linear(x.bfloat16(), wb)
    torch.testing.assert_close(y.float(), x @ w.t(), rtol=0.05, atol=0.3)  # bf16 inputs: ~3 significant digits
    for i in range(7):  # one row alone (padded to two) gives bitwise the row of the block
        assert torch.equal(linear(x[:, i:i + 1].bfloat16(), wb)[0, 0], y[0, i])
    # float32: the contiguous [in, out] copy, multiplied as x @ W_t. Not bitwise x @ w.t(): MKL's AVX2 kernels
    # sum in another order for the other layout (an AMD EPYC gave 1-ulp differences), so closeness is asserted
    assert orient(w).is_contiguous() and torch.equal(linear(x, orient(w)), x @ orient(w))
    torch.testing.assert_close(linear(x, orient(w)), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_draft_dtype_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(tb, "native_bf16", lambda: True)
    assert tb.default_draft_dtype("cpu", torch.float32) == torch.bfloat16
    monkeypatch.setattr(tb, "native_bf16", lambda: False)
    assert tb.default_draft_dtype("cpu", torch.float32) == torch.float32
    assert tb.default_draft_dtype("cuda", torch.bfloat16) == torch.bfloat16


def test_a_draft_beside_an_int8_row_target_runs_in_float32(monkeypatch):
    """Its matrices then join the target's int8-row kernels (measured ~5x cheaper than bf16 with AVX512-BF16)."""
    from hetero_sd.backends import placement
    from hetero_sd.backends.policy import LoadPolicy
    monkeypatch.setattr(tb, "native_bf16", lambda: True)
    assert tb.default_draft_dtype("cpu", torch.float32, torch.bfloat16, int8_rows=True) == torch.float32
    assert tb.default_draft_dtype("cpu", torch.float32, torch.bfloat16, int8_rows=False) == torch.bfloat16
    assert placement.draft_dtype_for(None, None, "cpu", torch.bfloat16, "int8") == torch.float32
    assert placement.draft_dtype_for(None, None, "cpu", torch.bfloat16, "float32") == torch.bfloat16
    # without the int8 draft layers the float32 draft would multiply dense float32: bf16 stays
    off = LoadPolicy(draft_int8_layers=False)
    assert placement.draft_dtype_for(None, None, "cpu", torch.bfloat16, "int8", off) == torch.bfloat16
    assert placement.draft_dtype_for("bfloat16", None, "cpu", torch.bfloat16, "int8") == torch.bfloat16  # asked


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not cpu.native_bf16()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert cpu.native_bf16() and "amx_bf16" in cpu.capability()


@pytest.mark.parametrize("draft_dtype", ["bfloat16", "float32"])
def test_draft_dtype_is_recorded_and_decoding_stays_lossless(tiny_llama, tiny_draft, draft_dtype):
    rt = load(str(tiny_llama), str(tiny_draft), draft_dtype=draft_dtype)
    spec = rt.generate([5, 9, 12, 20], max_new_tokens=30, block="fixed")  # the draft on every step
    base = rt.generate([5, 9, 12, 20], max_new_tokens=30, speculative=False)
    assert spec.token_ids == base.token_ids and spec.stats.num_drafts > 0
    assert rt.info["draft_dtype"] == draft_dtype == spec.stats.draft_dtype
    assert spec.stats.target_dtype == "float32" and base.stats.draft_dtype == ""


def test_bf16_draft_agrees_with_the_float32_draft(tiny_llama, tiny_draft):
    """Tolerance: cosine of the final hidden states >= 0.99 and top-1 agreement >= 0.8 (bf16 weights)."""
    f32 = load(str(tiny_llama), str(tiny_draft), draft_dtype="float32")
    bf16 = load(str(tiny_llama), str(tiny_draft), draft_dtype="bfloat16")
    features = f32.target.forward([5, 9, 12, 20, 7, 33, 41]).features
    out = {}
    for rt in (f32, bf16):
        rt.draft.add_context(features)
        out[rt.draft.dtype] = rt.draft.propose(11), rt.draft.last_hidden.float()
    (l32, h32), (l16, h16) = out[torch.float32], out[torch.bfloat16]
    assert torch.nn.functional.cosine_similarity(h32, h16, dim=-1).min() > 0.99
    assert (l32.argmax(-1) == l16.argmax(-1)).float().mean() >= 0.8


def test_bf16_target_parity_with_float32(tmp_path):
    """The bf16 target is a different target; stated tolerance against float32: logits cosine >= 0.995
    per position and top-1 agreement >= 0.9 (random tiny Llama, 40 positions)."""
    folder = make_tiny_target(tmp_path, "llama")
    ids = torch.randint(0, 64, (40,)).tolist()
    logits = {}
    for dtype in ("float32", "bfloat16"):
        rt = load(str(folder), None, dtype=dtype)
        logits[dtype] = torch.cat([rt.target.forward(ids[:24]).logits, rt.target.forward(ids[24:]).logits])
        assert rt.info["target_dtype"] == dtype
    a, b = logits["float32"], logits["bfloat16"]
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.995
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    rt = load(str(folder), None, dtype="bfloat16")
    assert any("different model than the float32" in n for n in rt.notes)


def test_a_reduced_precision_accelerator_target_says_that_token_identity_needs_float32():
    """A CUDA/MPS target defaults to bf16: its note says its GEMMs are not batch-invariant and how to get
    token identity; the CPU's note speaks of its own kernels."""
    from hetero_sd.backends.placement import target_dtype_note
    gpu = target_dtype_note(torch.bfloat16, "cuda")
    assert "cuda GEMMs are not batch-invariant" in gpu and "--dtype float32" in gpu
    assert target_dtype_note(torch.bfloat16, "cuda:0") == gpu  # the placement's own name for the device
    assert "CPU kernels are not batch-invariant" in target_dtype_note(torch.bfloat16, "cpu")
