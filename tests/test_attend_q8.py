"""A K cache of q8_0 blocks (kernels/attend_q8.h, llama.cpp's -ctk q8_0): RoPE writes each key's codes and
float16 scales exactly as llama.cpp's quantize_row_q8_0 makes them, the attention is the formula over those codes
(the query quantized the same way), and every row is bit for bit the same alone or in a block (decode and verify
agree) and in a batched generation's slots."""

from __future__ import annotations

import pytest
import torch

from hetero_sd.backends.torch_backend.cpu import cpu_flags
from hetero_sd.backends.torch_backend.layers import k_layout
from hetero_sd.backends.torch_backend.plan import Q8_K_FLAGS

from .test_fused import ext  # noqa: F401  (the fixture)


@pytest.fixture(autouse=True)
def _needs_vnni():
    if not Q8_K_FLAGS <= cpu_flags():
        pytest.skip("a q8_0 K cache needs AVX-512 with VNNI")


def q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's q8_0 of the last dim in blocks of 32: (codes as int64 [..., D], scales [..., D/32] as the
    float32 value of their float16)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    codes = (blocks * inv[..., None]).round().long()  # round: to nearest even, as the CPU's conversion
    return codes.reshape(x.shape), (amax / 127.0).half().float()


def read_tiles(kc: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A q8_0 K cache [S, nkv, cap, dim + dim/8] (bytes) -> (codes [S, nkv, cap, dim], scales [S, nkv, cap, dim/32])."""
    s, nkv, cap, width = kc.shape
    tiles = kc.reshape(s, nkv, cap // 16, 16 * width)
    codes = tiles[..., :16 * dim].reshape(s, nkv, cap // 16, dim // 4, 16, 4).permute(0, 1, 2, 4, 3, 5)
    codes = (codes.reshape(s, nkv, cap, dim).long() - 128)
    scales = tiles[..., 16 * dim:].contiguous().view(torch.float32).reshape(s, nkv, cap // 16, dim // 32, 16)
    return codes, scales.transpose(-1, -2).reshape(s, nkv, cap, dim // 32)


def caches(slots: int, nkv: int, cap: int, dim: int):
    width, dtype = k_layout(dim, torch.float16, True)
    return torch.zeros(slots, nkv, cap, width, dtype=dtype), torch.zeros(slots, nkv, cap, dim, dtype=torch.float16)


def fill(ext, kc, vc, kf, vf, nh, start, steps, seed):  # noqa: F811
    """Random q|k|v rows through RoPE into positions start.. of a one-slot q8_0 cache (kc, vc) and of float32
    caches in rows (kf, vf: the values the q8_0 cache quantizes); their q."""
    nkv, dim = vc.shape[1], vc.shape[3]
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, steps, (nh + 2 * nkv) * dim, generator=g) * 3
    cos, sin = torch.randn(steps, dim, generator=g), torch.randn(steps, dim, generator=g)
    q = ext.rope(qkv, cos, sin, kf, vf, start, nh, nkv, None, None, 0.0, False)
    assert torch.equal(ext.rope(qkv, cos, sin, kc, vc, start, nh, nkv, None, None, 0.0, True), q)
    return q


def floats(slots: int, nkv: int, cap: int, dim: int):
    return torch.zeros(slots, nkv, cap, dim), torch.zeros(slots, nkv, cap, dim)


@pytest.mark.parametrize("dim", [64, 128])
def test_rope_writes_llama_cpp_q8_0_keys(ext, dim):  # noqa: F811
    nh, nkv, cap, start, steps = 6, 2, 64, 13, 30
    kc, vc = caches(1, nkv, cap, dim)
    kf, vf = floats(1, nkv, cap, dim)
    fill(ext, kc, vc, kf, vf, nh, start, steps, 0)
    codes, scales = read_tiles(kc, dim)
    want_codes, want_scales = q8(kf)
    span = slice(start, start + steps)
    assert torch.equal(codes[:, :, span], want_codes[:, :, span]) and torch.equal(scales[:, :, span], want_scales[:, :, span])
    assert torch.equal(vc.float(), vf.half().float())
    outside = torch.ones(cap, dtype=torch.bool)
    outside[span] = False
    assert (codes[:, :, outside] == -128).all() and not scales[:, :, outside].any()  # nothing else written (zero bytes)


def reference(q, kf, vf, start, causal):
    """The q8_0 scores' formula in float64 over the codes both sides get, softmax, float16 V."""
    nh, steps, dim = q.shape[1], q.shape[2], q.shape[3]
    n = start + steps
    qc, qs = q8(q)
    kc, ks = q8(kf[:, :, :n])
    kc, ks = kc.repeat_interleave(nh // kf.shape[1], 1), ks.repeat_interleave(nh // kf.shape[1], 1)
    blocks = dim // 32
    isum = torch.einsum("bhtkc,bhjkc->bhtjk", qc.reshape(1, nh, steps, blocks, 32).double(),
                        kc.reshape(1, nh, n, blocks, 32).double())
    scores = (isum * qs.double()[:, :, :, None, :] * ks.double()[:, :, None, :, :]).sum(-1) / dim ** 0.5
    if causal:
        mask = torch.arange(n)[None, :] <= torch.arange(steps)[:, None] + start
        scores = scores.masked_fill(~mask, float("-inf"))
    v = vf[:, :, :n].half().double().repeat_interleave(nh // kf.shape[1], 1)
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, steps, nh * dim).float()


@pytest.mark.parametrize("dim,start", [(64, 37), (128, 37), (64, 250)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "block"])
def test_attention_is_the_q8_0_formula_and_each_row_the_same_alone_or_in_a_block(ext, dim, start, causal):  # noqa: F811
    nh, nkv, steps = 9, 3, 16
    cap = (start + steps + 15) // 16 * 16 + 16
    kc, vc = caches(1, nkv, cap, dim)
    kf, vf = floats(1, nkv, cap, dim)
    fill(ext, kc, vc, kf, vf, nh, 0, start, 1)  # the context
    q = fill(ext, kc, vc, kf, vf, nh, start, steps, 2)  # the block's own rows
    got = ext.attend(q, kc, vc, start, True, causal, True)
    torch.testing.assert_close(got, reference(q, kf, vf, start, causal), rtol=1e-5, atol=1e-5)
    if not causal:
        return
    for t in range(steps):  # a decode step at position start+t gives the verify block's row bit for bit
        assert torch.equal(ext.attend(q[:, :, t:t + 1].contiguous(), kc, vc, start + t, True, True, True), got[:, t:t + 1])
    for rows in (2, 3, 5, 8):  # and so does any shorter block (other work items, other row groups)
        assert torch.equal(ext.attend(q[:, :, :rows].contiguous(), kc, vc, start, True, True, True), got[:, :rows])


def test_slot_rows_are_each_sequences_own_decode_step(ext):  # noqa: F811
    """Batched generation on a q8_0 K: row r's q, K/V writes and output are its sequence's own decode step's."""
    nh, nkv, dim, cap, slots = 6, 2, 64, 96, 5
    kc, vc = caches(slots, nkv, cap, dim)
    kf, vf = floats(1, nkv, cap, dim)
    for s in range(slots):  # every slot's context
        fill(ext, kc[s:s + 1], vc[s:s + 1], kf, vf, nh, 0, 80, 10 + s)
    g = torch.Generator().manual_seed(4)
    rows, pos = torch.tensor([3, 0, 4, 1]), torch.tensor([70, 5, 33, 16])
    qkv = torch.randn(len(rows), 1, (nh + 2 * nkv) * dim, generator=g)
    cos, sin = torch.randn(len(rows), dim, generator=g), torch.randn(len(rows), dim, generator=g)
    before_k, before_v = kc.clone(), vc.clone()
    q = ext.rope_slots(qkv, cos, sin, kc, vc, rows, pos, nh, nkv, None, None, 0.0, True)
    o = ext.attend_slots(q, kc, vc, rows, pos, True, True)
    for r, (s, p) in enumerate(zip(rows.tolist(), pos.tolist())):
        k1, v1 = before_k[s:s + 1].clone(), before_v[s:s + 1].clone()
        q1 = ext.rope(qkv[r:r + 1], cos[r:r + 1], sin[r:r + 1], k1, v1, p, nh, nkv, None, None, 0.0, True)
        assert torch.equal(q[r:r + 1].transpose(1, 2), q1.transpose(1, 2))
        assert torch.equal(kc[s:s + 1], k1) and torch.equal(vc[s:s + 1], v1)
        assert torch.equal(o[r:r + 1], ext.attend(q1, k1, v1, p, True, True, True)), r
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(kc[untouched], before_k[untouched]) and torch.equal(vc[untouched], before_v[untouched])


def test_a_q8_0_cache_is_refused_where_it_cannot_be_read(ext):  # noqa: F811
    kc, vc = caches(1, 2, 32, 64)
    q = torch.randn(1, 4, 1, 64)
    with pytest.raises(RuntimeError, match="AVX-512 stages"):
        ext.attend(q, kc, vc, 0, False, True, True)
    with pytest.raises(RuntimeError, match="q8_0 K cache takes"):
        ext.attend(q, kc, vc.float(), 0, True, True, True)  # a float32 V
    with pytest.raises(RuntimeError, match="q8_0 K cache takes"):
        ext.attend(q, kc, vc, 0, True, True, False)  # K in rows, not tiled
    k80, v80 = torch.zeros(1, 2, 32, 90, dtype=torch.uint8), torch.zeros(1, 2, 32, 80, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="whole blocks of 32"):  # a head of 80: no whole q8_0 blocks
        ext.rope(torch.randn(1, 1, 6 * 80), torch.ones(1, 80), torch.zeros(1, 80), k80, v80, 0, 2, 2, None, None, 0.0, True)
