"""The quantized target kernel (backends/torch_backend/quant.py): x @ W^T for W as GGUF Q4_1/Q8_0 blocks
equals a float64 matmul on the dequantized blocks within float32 rounding, on each ISA the CPU has; a row
gives bitwise the same result alone or in any block of rows (and on either ISA); the load-time check
refuses blocks that do not dequantize to the float32 weights; on the real default target, the quantized
path decodes the same tokens as float32 within the parity tests' tolerance, and DFlash on it is lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero_sd.backends.torch_backend import quant
from hetero_sd.backends.torch_backend.cpu import cpu_flags

pytestmark = pytest.mark.skipif(quant.isa() is None, reason="no AVX-512 nor AVX2+FMA+F16C on this CPU")

ISAS = ["avx2"] + (["avx512"] if "avx512f" in cpu_flags() else [])
ROWS = [1, 2, 3, 7, 16, 33, 64]


def random_rows(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n GGUF rows of k inputs: fp16 scales (and mins) of a real model's range, random quants."""
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    scale = lambda lo, hi: (torch.rand(n, kb, generator=g) * (hi - lo) + lo).half().view(torch.uint8).view(n, kb, 2)
    if kind == quant.Q4_1:
        parts = [scale(0.001, 0.02), scale(-0.15, 0.0), torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)]
    else:
        parts = [scale(0.0005, 0.01), torch.randint(0, 256, (n, kb, 32), generator=g, dtype=torch.uint8)]
    return torch.cat(parts, -1).reshape(n, -1).numpy()


def isa_switch(monkeypatch, kernel):
    """use(name): the kernels of `kernel` (quant, quant8) built from then on take this ISA
    (the AVX2 kernel on an AVX-512 CPU is the code an AVX2-only CPU runs)."""
    choose = kernel.isa

    def use(name):
        monkeypatch.setattr(kernel, "isa", lambda prefer=name, flags=None: choose(prefer, flags))
        assert kernel.isa() == name
    return use


@pytest.fixture
def on_isa(monkeypatch):
    return isa_switch(monkeypatch, quant)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,n,k", [(quant.Q4_1, 77, 576), (quant.Q4_1, 33, 1536), (quant.Q8_0, 131, 64)])
def test_kernel_matches_the_dequantized_matmul(on_isa, isa, kind, n, k):
    on_isa(isa)
    rows = random_rows(kind, n, k)
    w = quant.dequantize(kind, rows)  # [n, k] float32, as the converter computes it
    q = quant.Quantized(kind, rows, None, w.t())
    torch.manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k) * 2
        exact = x.double() @ w.double().t()
        ours = (q(x).double() - exact).abs().max()
        torchs = ((x @ w.t()).double() - exact).abs().max()
        assert ours <= 4 * torchs + 1e-6 * exact.abs().max(), (m, ours, torchs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", [quant.Q4_1, quant.Q8_0])
def test_a_row_is_bitwise_the_same_in_any_block(on_isa, isa, kind):
    on_isa(isa)
    rows = random_rows(kind, 45, 576, seed=2)
    q = quant.Quantized(kind, rows, None)
    x = torch.randn(64, 576)
    full = q(x)
    for r in range(64):
        assert torch.equal(q(x[r:r + 1]), full[r:r + 1])
    for m in ROWS:
        assert torch.equal(q(x[:m]), full[:m])
    assert torch.equal(q(x[5:21]), full[5:21])


@pytest.mark.skipif(len(ISAS) < 2, reason="one ISA on this CPU")
def test_both_isas_give_bitwise_the_same_result(on_isa):
    rows = random_rows(quant.Q4_1, 40, 576, seed=3)
    x = torch.randn(9, 576)
    on_isa("avx512")
    wide = quant.Quantized(quant.Q4_1, rows, None)(x)
    on_isa("avx2")
    assert torch.equal(quant.Quantized(quant.Q4_1, rows, None)(x), wide)


@pytest.mark.parametrize("kind", [quant.Q4_1, quant.Q8_0])
def test_load_check_refuses_other_weights(kind):
    rows = random_rows(kind, 20, 128, seed=4)
    w = quant.dequantize(kind, rows)
    assert quant.Quantized(kind, rows, None, w.t()).n == 20  # the transposed view: [in, out] as layers keep it
    assert quant.Quantized(kind, rows, None, w.t().contiguous()).n == 20
    off = w.clone()
    off[7, 100] = torch.nextafter(off[7, 100], torch.tensor(1.0))  # one ulp
    with pytest.raises(ValueError, match="do not dequantize"):
        quant.Quantized(kind, rows, None, off.t())


def test_shapes_and_the_prefill_fallback():
    from hetero_sd.backends.torch_backend.layers import linear

    rows = random_rows(quant.Q4_1, 30, 64)
    w_t = quant.dequantize(quant.Q4_1, rows).t().contiguous()
    q = quant.Quantized(quant.Q4_1, rows, w_t, w_t)
    assert linear(torch.randn(1, 5, 64), q).shape == (1, 5, 30)
    long = torch.randn(quant.MAX_ROWS + 1, 64)
    assert torch.equal(linear(long, q), long @ w_t)  # a prefill multiplies the float32 weight


def test_gguf_header_walk_reads_the_embedded_file():
    from hetero_sd.loading.default_model import embedded_gguf

    gguf = pytest.importorskip("gguf")
    path = embedded_gguf()
    ours = quant.gguf_tensors(path)
    theirs = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert ours and set(ours) == {n for n, t in theirs.items() if t.tensor_type.name in quant.BLOCK_BYTES}
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        kind, rows = ours[name]
        assert kind == theirs[name].tensor_type.name and np.array_equal(rows, theirs[name].data)


# ---- the real default target (SmolLM2-135M-Instruct: Q4_1 layers, Q8_0 embedding/head) ----

PROMPTS = ["Write a Python function that checks whether a number is prime.", "Explain what a hash table is."]


@pytest.fixture(scope="module")
def both(default_folder):
    """The default target with the cpu-trained draft, as the float32 target (`--dtype float32`; the default
    on a GGUF is int8 rows, test_quant8.py): float32 rows times its GGUF blocks, and float32 weights (opted out)."""
    import hetero_sd
    from hetero_sd.cli.policy import policy_from_env

    quantized = hetero_sd.load("default", "cpu-trained", block_size=8, dtype="float32")
    plain = hetero_sd.load("default", "cpu-trained", block_size=8, dtype="float32",
                           policy=policy_from_env({"HETERO_SD_QUANT": "off"}))
    return quantized, plain


@pytest.mark.slow
def test_default_target_is_quantized_and_says_so(both):
    quantized, plain = both
    assert quantized.target.weight_format == quant.WEIGHTS and plain.target.weight_format == "float32"
    assert any(n.startswith(quant.NOTE + ": " + quant.WEIGHTS) for n in quantized.notes)
    assert any("HETERO_SD_QUANT=off" in n for n in plain.notes)
    assert isinstance(quantized.target.mm_head, quant.Quantized)
    assert all(isinstance(getattr(b, a), quant.Quantized) for b in quantized.target.layers
               for a in ("mm_qkv", "mm_o", "mm_gate_up", "mm_down"))


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_quantized_decodes_as_float32_and_dflash_stays_lossless(both, prompt):
    quantized, plain = both
    base = quantized.generate(prompt, max_new_tokens=64, speculative=False)
    assert base.token_ids == plain.generate(prompt, max_new_tokens=64, speculative=False).token_ids
    assert quantized.generate(prompt, max_new_tokens=64).token_ids == base.token_ids  # lossless


@pytest.mark.slow
def test_quantized_logits_within_the_parity_tolerance(both):
    quantized, plain = both
    ids = quantized.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    outs = []
    for rt in (quantized, plain):
        t = rt.target.fork()
        prefill = t.forward(ids[:-9], features=False).logits[-1]
        verify = t.forward(ids[-9:-1], features=False).logits  # 8 rows: the verify kernel
        decode = t.forward(ids[-1:], features=False).logits  # 1 row: the decode kernel
        outs.append(torch.cat([prefill[None], verify, decode]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_decode_and_verify_rows_are_bitwise_the_same_through_the_default_target(both):
    """Not only each kernel: the whole target (fused ops, attention, GGUF blocks) gives a position the same
    logits in a verify block as in a decode step, so DFlash on it cannot differ from plain decoding."""
    t = both[0].target.fork()
    ids = both[0].tokenizer.encode(PROMPTS[1] + " " + PROMPTS[0])
    t.forward(ids[:-8], features=False)
    block = t.forward(ids[-8:], features=False).logits
    t.crop(len(ids) - 8)
    assert torch.equal(block, torch.cat([t.forward([i], features=False).logits for i in ids[-8:]]))
