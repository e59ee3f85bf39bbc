"""The fused layer ops (backends/torch_backend/fused.py): the same function as the torch-op layer, row by
row the same alone or in a block (decode and verify agree), and decoding through them is lossless."""

from __future__ import annotations

import shutil

import pytest
import torch

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.backends.torch_backend import fused
from hetero_sd.backends.torch_backend.layers import apply_rope, rms_norm
from hetero_sd.backends.torch_backend.gemm import KernelUnavailable

from .conftest import make_tiny_target


@pytest.fixture(scope="module")
def ext():
    try:
        return fused.extension()
    except KernelUnavailable as e:
        if shutil.which("c++") or shutil.which("g++"):  # a compiler that fails on our source is a failure
            raise
        pytest.skip(f"no C++ toolchain: {e}")


def test_each_op_is_the_torch_formula_and_row_invariant(ext):
    torch.manual_seed(0)
    x, w, d = torch.randn(1, 7, 96), torch.randn(96), torch.randn(1, 7, 96)
    torch.testing.assert_close(ext.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    s, y = ext.add_rms_norm(x, d, w, 1e-5)
    torch.testing.assert_close(s, x + d)
    torch.testing.assert_close(y, rms_norm(x + d, w, 1e-5), rtol=1e-5, atol=1e-6)
    gu = torch.randn(1, 7, 2 * 43) * 8  # 43: a row's tail past its last group of 8 lanes; * 8: large |g| too
    gu[0, 0, :3] = torch.tensor([-120.0, 95.0, 0.0])  # e^-g past the clamps
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(ext.silu_mul(gu), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
    xs, ws, gus = torch.randn(1, 20, 576), torch.randn(576), torch.randn(1, 20, 2 * 1536)  # rows over threads
    torch.testing.assert_close(ext.rms_norm(xs, ws, 1e-5), rms_norm(xs, ws, 1e-5), rtol=1e-5, atol=1e-6)
    for t in (0, 13, 19):
        assert torch.equal(ext.rms_norm(xs[:, t:t + 1], ws, 1e-5), ext.rms_norm(xs, ws, 1e-5)[:, t:t + 1])
        assert torch.equal(ext.silu_mul(gus[:, t:t + 1]), ext.silu_mul(gus)[:, t:t + 1])
    for t in range(7):  # one row alone gives bitwise what it gives inside the block
        assert torch.equal(ext.rms_norm(x[:, t:t + 1], w, 1e-5), ext.rms_norm(x, w, 1e-5)[:, t:t + 1])
        assert torch.equal(ext.silu_mul(gu[:, t:t + 1]), ext.silu_mul(gu)[:, t:t + 1])


def test_rope_and_cache_write_match_the_torch_layer(ext):
    torch.manual_seed(1)
    nh, nkv, dim, steps, start = 4, 2, 16, 5, 3
    qkv = torch.randn(1, steps, (nh + 2 * nkv) * dim)
    angles = torch.randn(steps, dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    kc, vc = torch.zeros(1, nkv, 16, dim), torch.zeros(1, nkv, 16, dim)
    q, keys, values = ext.rope_qkv(qkv, cos, sin, kc, vc, start, nh, nkv, True)
    assert len(ext.rope_qkv(qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv, False)) == 1
    heads = lambda x, n: x.view(1, steps, n, dim).transpose(1, 2)  # noqa: E731
    qt, kt, vt = qkv.split([nh * dim, nkv * dim, nkv * dim], -1)
    torch.testing.assert_close(q, apply_rope(heads(qt, nh), cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(keys[:, :, start:], apply_rope(heads(kt, nkv), cos, sin), rtol=1e-6, atol=1e-6)
    assert torch.equal(values[:, :, start:], heads(vt, nkv)) and keys.shape[2] == start + steps
    assert not kc[:, :, :start].any() and not kc[:, :, start + steps:].any()  # nothing else written


def tiled(k: torch.Tensor) -> torch.Tensor:
    """A K cache [1, nkv, cap, D] in the tiled layout (key j's d-th value at (j/16)*16*D + d*16 + j%16)."""
    _, nkv, cap, dim = k.shape
    return k.view(1, nkv, cap // 16, 16, dim).transpose(-1, -2).reshape(1, nkv, cap, dim)


def test_rope_writes_a_tiled_k_cache(ext):
    """tiled=True: the same k values, each in its tile of 16 positions d-major; v as ever."""
    torch.manual_seed(3)
    nh, nkv, dim, cap, start = 3, 1, 64, 48, 13
    for kv in (torch.float32, torch.float16):
        qkv, cos, sin = torch.randn(1, 7, (nh + 2 * nkv) * dim), torch.randn(7, dim), torch.randn(7, dim)
        kc, vc = torch.zeros(1, nkv, cap, dim, dtype=kv), torch.zeros(1, nkv, cap, dim, dtype=kv)
        kt, vt = kc.clone(), vc.clone()
        q = ext.rope(qkv, cos, sin, kc, vc, start, nh, nkv)
        assert torch.equal(ext.rope(qkv, cos, sin, kt, vt, start, nh, nkv, None, None, 0.0, True), q)
        assert torch.equal(kt, tiled(kc)) and torch.equal(vt, vc) and kc[:, :, start].any()
    with pytest.raises(RuntimeError, match="whole tiles"):
        ext.rope(qkv, cos, sin, torch.zeros(1, nkv, 40, dim), torch.zeros(1, nkv, 40, dim), 0, nh, nkv, None, None, 0.0, True)


@pytest.mark.parametrize("layout", ["rows", "tiled"])
@pytest.mark.parametrize("wide", [False, True], ids=["8-lane", "16-lane"])
@pytest.mark.parametrize("dim,start", [(64, 37), (128, 37), (64, 250)])
def test_attention_is_sdpa_and_each_row_the_same_alone_or_in_a_block(ext, dim, start, wide, layout):
    if not (ext.has_attend and {"avx2", "fma"} <= fused.cpu_flags()):
        pytest.skip("the attention kernel needs x86-64 with AVX2 and FMA")
    if wide and "avx512f" not in fused.cpu_flags():
        pytest.skip("the 16-lane attention kernel needs AVX-512F")
    torch.manual_seed(2)
    nh, nkv, cap, steps = 6, 2, 272, 9
    kc, vc, q = torch.randn(1, nkv, cap, dim), torch.randn(1, nkv, cap, dim), torch.randn(1, nh, steps, dim)
    mask = torch.arange(start + steps)[None, :] <= torch.arange(steps)[:, None] + start
    want = torch.nn.functional.scaled_dot_product_attention(q, kc[:, :, :start + steps], vc[:, :, :start + steps],
                                                            attn_mask=mask, enable_gqa=True)
    kc[:, :, start + steps:] = 1e4  # past the rows' keys (a longer context, cropped): never seen
    is_tiled = layout == "tiled"
    kc = tiled(kc) if is_tiled else kc
    got = ext.attend(q, kc, vc, start, wide, True, is_tiled)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(1, steps, nh * dim), rtol=1e-5, atol=1e-6)
    for t in range(steps):  # a decode step at position start+t gives the verify block's row bit for bit
        assert torch.equal(ext.attend(q[:, :, t:t + 1].contiguous(), kc, vc, start + t, wide, True, is_tiled),
                           got[:, t:t + 1])
    for rows in (2, 5):  # and so does any shorter block (other work items, other row groups)
        assert torch.equal(ext.attend(q[:, :, :rows].contiguous(), kc, vc, start, wide, True, is_tiled), got[:, :rows])


@pytest.mark.parametrize("wide", [False, True])
def test_float16_caches_are_read_and_written_as_their_float32_values(ext, wide):
    """A float16 K/V cache (the int8 target's): RoPE writes each k and v rounded to nearest even, and the
    attention reads them converted exactly, so its output is bit for bit that of a float32 cache holding the
    same rounded values, causal or not, for 1-16 rows."""
    if wide and "avx512f" not in fused.cpu_flags():
        pytest.skip("the 16-lane attention kernel needs AVX-512F")
    torch.manual_seed(0)
    nh, nkv, dim, cap, start = 6, 2, 64, 320, 200
    for steps in (1, 3, 16):
        qkv, cos, sin = torch.randn(1, steps, (nh + 2 * nkv) * dim), torch.randn(steps, dim), torch.randn(steps, dim)
        for layout in (False, True):  # K in rows, K tiled by 16 positions
            kf, vf = torch.randn(1, nkv, cap, dim).half().float(), torch.randn(1, nkv, cap, dim).half().float()
            kh, vh = kf.half(), vf.half()
            q = ext.rope(qkv, cos, sin, kf, vf, start, nh, nkv, None, None, 0.0, layout)
            assert torch.equal(ext.rope(qkv, cos, sin, kh, vh, start, nh, nkv, None, None, 0.0, layout), q)
            assert torch.equal(kh, kf.half()) and torch.equal(vh, vf.half())
            kf, vf = kh.float(), vh.float()  # what the float16 cache holds
            for causal in (True, False):
                assert torch.equal(ext.attend(q, kh, vh, start, wide, causal, layout),
                                   ext.attend(q, kf, vf, start, wide, causal, layout))


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("wide", [False, True], ids=["8-lane", "16-lane"])
@pytest.mark.parametrize("layout", [False, True], ids=["rows", "tiled"])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "qk-norms"])
def test_slot_rows_are_each_sequences_own_decode_step(ext, kv, wide, layout, norms):
    """Batched data generation's rows (rope_slots + attend_slots): row r is one token of the sequence in cache
    slot slots[r] at position pos[r]; its q, the K/V it writes and its attention output are bit for bit those
    of that sequence's own decode step (rope_qkv + attend on a one-sequence cache), whatever rows are beside
    it; other slots and positions are left untouched."""
    if not (ext.has_attend and {"avx2", "fma"} <= fused.cpu_flags()):
        pytest.skip("the attention kernel needs x86-64 with AVX2 and FMA")
    if wide and "avx512f" not in fused.cpu_flags():
        pytest.skip("the 16-lane attention kernel needs AVX-512F")
    torch.manual_seed(4)
    nh, nkv, dim, cap, slots = 6, 2, 64, 96, 5
    kc, vc = torch.randn(slots, nkv, cap, dim).to(kv), torch.randn(slots, nkv, cap, dim).to(kv)
    rows, pos = torch.tensor([3, 0, 4, 1]), torch.tensor([70, 5, 33, 16])
    qkv = torch.randn(len(rows), 1, (nh + 2 * nkv) * dim)
    cos, sin = torch.randn(len(rows), dim), torch.randn(len(rows), dim)
    qn = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5, 1e-6) if norms else (None, None, 0.0)
    before_k, before_v = kc.clone(), vc.clone()
    q = ext.rope_slots(qkv, cos, sin, kc, vc, rows, pos, nh, nkv, *qn, layout)
    o = ext.attend_slots(q, kc, vc, rows, pos, wide, layout)
    assert q.shape == (4, nh, 1, dim) and o.shape == (4, 1, nh * dim)
    for r, (s, p) in enumerate(zip(rows.tolist(), pos.tolist())):
        k1, v1 = before_k[s:s + 1].clone(), before_v[s:s + 1].clone()
        q1 = ext.rope(qkv[r:r + 1], cos[r:r + 1], sin[r:r + 1], k1, v1, p, nh, nkv, *qn, layout)
        assert torch.equal(q[r:r + 1].transpose(1, 2), q1.transpose(1, 2)) and torch.equal(kc[s:s + 1], k1)
        assert torch.equal(vc[s:s + 1], v1)
        assert torch.equal(o[r:r + 1], ext.attend(q1, k1, v1, p, wide, True, layout)), r
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(kc[untouched], before_k[untouched]) and torch.equal(vc[untouched], before_v[untouched])
    with pytest.raises(RuntimeError, match="out of range"):
        ext.attend_slots(q, kc, vc, torch.tensor([3, 0, 5, 1]), pos, wide, layout)


QWEN_STYLE = {"qwen3, q/k norms, SDPA": ("qwen3", {}), "qwen3, q/k norms, C++ attention": ("qwen3", {"head_dim": 64}),
              "qwen2, q|k|v bias": ("qwen2", {})}


@pytest.fixture(params=["llama"] + list(QWEN_STYLE), scope="module")
def family_target(request, tiny_llama, tmp_path_factory):
    if request.param == "llama":
        return tiny_llama
    model_type, overrides = QWEN_STYLE[request.param]
    folder = make_tiny_target(tmp_path_factory.mktemp(model_type), model_type, **overrides)
    if model_type == "qwen2":  # transformers initialises biases to zero: a dropped bias would go unseen
        from safetensors.torch import load_file, save_file
        tensors = load_file(folder / "model.safetensors")
        for name, t in tensors.items():
            if name.endswith("_proj.bias"):
                tensors[name] = torch.randn_like(t) * 0.5
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_fused_target_is_the_torch_op_target(family_target, ext):
    """Llama's layers, Qwen3's (q/k norms inside the RoPE op; head_dim 64 takes the C++ attention too) and
    Qwen2's (the q|k|v bias): the fused ops give the torch ops' logits and the same tokens."""
    prompt = [5, 9, 12, 20, 7, 33, 2, 14]
    fast = hetero_sd.load(str(family_target), "random:1", block_size=4)
    assert fast.target.fused
    slow = hetero_sd.load(str(family_target), "random:1", block_size=4, policy=LoadPolicy(fused=False))
    assert not slow.target.fused
    outs = []
    for rt in (fast, slow):
        rt.target.crop(0)
        prefill = rt.target.forward(prompt)
        outs.append((prefill.logits, prefill.features, rt.target.forward([3, 4, 5]).logits))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    base = slow.generate(prompt, max_new_tokens=40, speculative=False).token_ids
    assert fast.generate(prompt, max_new_tokens=40, speculative=False).token_ids == base
    assert fast.generate(prompt, max_new_tokens=40).token_ids == base  # DFlash through the fused layers


@pytest.mark.parametrize("rows", ["int8", "int8, q8_0 K", "float32"])
@pytest.mark.parametrize("style", ["llama", "qwen3 norms + qwen2 bias"])
def test_the_one_call_walk_is_bitwise_the_python_walk(ext, rows, style):
    """FusedLayerOps.layers (kernels/fused.cpp `layers`) runs the same kernels in the same order as the walk in
    Python: the same bits for the rows, the captured layers and both caches, for int8 rows (quant8.Int8Blocks,
    float16 caches, or K as q8_0 blocks with the 16-lane stages) and float32 rows (quant.Quantized), with q/k norms
    and a q|k|v bias or without; more rows than a float32-rows product takes (a prefill) walk in Python."""
    from types import SimpleNamespace

    from hetero_sd.backends.torch_backend import quant, quant8
    from hetero_sd.backends.torch_backend.layers import KVCache, through_layers

    from .test_quant import random_rows

    from hetero_sd.backends.torch_backend.plan import Q8_K_FLAGS

    int8, q8 = rows.startswith("int8"), rows.endswith("q8_0 K")
    if (quant8 if int8 else quant).isa() is None:
        pytest.skip("no GGUF-block kernel on this CPU")
    if q8 and not Q8_K_FLAGS <= fused.cpu_flags():
        pytest.skip("a q8_0 K cache needs AVX-512 with VNNI")
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5)
    H, I, g = 256, 512, torch.Generator().manual_seed(0)
    make = quant8.Int8Blocks if int8 else quant.Quantized
    qwen = style != "llama"

    def matrix(n, k, seed):
        kind = quant.Q4_1 if seed % 2 else quant.Q8_0  # both kinds in one walk
        blocks = random_rows(kind, n, k, seed)
        return make(kind, blocks, quant.dequantize(kind, blocks).t().contiguous())

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)
    layers = [SimpleNamespace(mm_qkv=matrix(H + 256, H, 4 * i), mm_o=matrix(H, H, 4 * i + 1),
                              mm_gate_up=matrix(2 * I, H, 4 * i + 2), mm_down=matrix(H, I, 4 * i + 3),
                              bqkv=torch.randn(H + 256, generator=g) * 0.5 if qwen else None,
                              q_norm=norm(64) if qwen else None, k_norm=norm(64) if qwen else None,
                              in_norm=norm(H), post_norm=norm(H), nq=H) for i in range(3)]
    walk = tuple((layer, layer.post_norm, nxt) for layer, nxt in zip(layers, [x.in_norm for x in layers[1:]] + [norm(H)]))
    cache_dtype = torch.float16 if int8 else torch.float32
    theta = 1 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    angles = torch.outer(torch.arange(200).float(), theta)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    results = []
    for stack in (False, True):
        ops = fused.FusedLayerOps(cfg, True, q8, stack=stack)  # (q8_0 K: the 16-lane stages)
        cache, out = KVCache(cfg, 3, "cpu", cache_dtype, 512, k_q8=q8), []
        start = 0
        for T in (70, 1, 5):  # a prefill (float32 rows: more than the product takes), a decode, a verify
            h = torch.randn(1, T, H, generator=torch.Generator().manual_seed(T))
            x, captured = through_layers(ops, walk, h, layers[0].in_norm, cache, start, cos[start:start + T],
                                         sin[start:start + T], None, capture=(0, 2))
            out += [x, *captured]
            start += T
        results.append(out + cache.k + cache.v)
        assert (list(ops.stacks.values())[0][1] is not None) if stack else not ops.stacks
    assert len(results[0]) == len(results[1]) == 3 * 3 + 6 and all(torch.equal(a, b) for a, b in zip(*results))
