"""A CPU draft whose head multiplies int8 rows by GGUF blocks multiplies its own matrices the same way, as
Q8_0 (or, asked for, Q4_1) blocks quantized at load (backends/torch_backend/plan.py draft_blocks): a draft only proposes, the
target verifies. Its proposals stay those of the float32 draft nearly everywhere, decoding stays lossless,
and drafts whose logits are compared exactly (no GGUF head: the parity tests' tiny targets) keep float32."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
from hetero_sd.backends.torch_backend import quant8
from hetero_sd.cli.policy import policy_from_env

pytestmark = pytest.mark.skipif(quant8.isa() is None, reason="no AVX512-VNNI nor AVX2+FMA+F16C on this CPU")

MATRICES = ("mm_qkv", "mm_o", "mm_gate_up", "mm_down", "mm_kv")


def int8_matrices(rt) -> list[bool]:
    return [isinstance(rt.draft.model.mm_fc, quant8.Int8Blocks)] + [
        isinstance(getattr(layer, a), quant8.Int8Blocks) for layer in rt.draft.layers for a in MATRICES]


@pytest.mark.slow
def test_default_draft_layers_are_int8_blocks_and_propose_what_float32_does(default_folder):
    rt = hetero_sd.load("default", "cpu-trained", block_size=8)
    ref = hetero_sd.load("default", "cpu-trained", block_size=8,
                         policy=policy_from_env({"HETERO_SD_DRAFT_LAYERS": "float"}))
    assert all(int8_matrices(rt)) and not any(int8_matrices(ref))
    assert any(n.startswith("draft layers: 11 matrices as Q8_0 blocks") for n in rt.notes)
    q4 = hetero_sd.load("default", "cpu-trained", block_size=8, policy=policy_from_env({"HETERO_SD_DRAFT_LAYERS": "q4_1"}))
    assert any(n.startswith("draft layers: 11 matrices as Q4_1 blocks") for n in q4.notes)
    assert q4.draft.read_bytes() < rt.draft.read_bytes() < ref.draft.read_bytes()
    for prompt in ("Write a haiku about the sea.",):  # Q4_1 layers: lossless too
        assert q4.generate(prompt, max_new_tokens=48).token_ids == q4.generate(prompt, max_new_tokens=48, speculative=False).token_ids
    ids = rt.tokenizer.encode("Explain what a hash table is, and how collisions are handled. " * 3)
    agree = total = 0
    for r in (rt, ref):
        r.draft.add_context(r.target.fork().forward(ids[:-1]).features)
    for anchor in ids[-4:]:
        a, b = rt.draft.propose(anchor).argmax(-1), ref.draft.propose(anchor).argmax(-1)
        agree, total = agree + int((a == b).sum()), total + a.numel()
    assert agree >= 0.8 * total, (agree, total)  # Q8_0 layers: 14 of 15 on one block; a wrong layout: ~0
    for prompt in ("Write a haiku about the sea.", "Write a Python function that reverses a list."):
        assert rt.generate(prompt, max_new_tokens=48).token_ids == \
            rt.generate(prompt, max_new_tokens=48, speculative=False).token_ids


def test_a_draft_without_an_int8_head_keeps_float32_layers(tiny_llama):
    rt = hetero_sd.load(str(tiny_llama), "random", block_size=4)
    assert not any(int8_matrices(rt))
    assert not any(n.startswith("draft layers") for n in rt.notes)


@pytest.mark.slow
def test_draft_block_on_fused_ops_is_torchs_within_float_rounding(default_folder):
    """The block through the target's fused layer ops (C++ norms, RoPE with the draft's q/k norms and the cache
    write, SwiGLU, and the non-causal attention over the cached context: every row sees all start+T keys)
    gives the torch ops' and SDPA's result within float32 rounding; float layers on both sides, so that int8
    codes do not amplify the rounding (a missing q/k norm or a causal mask moves logits by whole units)."""
    from hetero_sd.backends.policy import LoadPolicy
    from hetero_sd.decoding.costs import fill_ids

    # float32 asked for: without its int8 layers a 16-bit draft runs in bf16 on a CPU with native bf16. The
    # head in float too: int8 codes of the final hidden states turn a 1e-6 difference (the 16-lane attention's
    # order on AVX-512 against SDPA's) into a flipped code, 0.008 in a logit (a Zen 5 EPYC)
    floats = dict(draft_int8_layers=False, draft_int8_head=False)
    fast = hetero_sd.load("default", "cpu-trained", block_size=8, draft_dtype="float32", policy=LoadPolicy(**floats))
    ref = hetero_sd.load("default", "cpu-trained", block_size=8, draft_dtype="float32",
                         policy=LoadPolicy(**floats, fused=False))
    assert fast.draft.model.attend_kernel is not None and ref.draft.model.attend_kernel is None
    assert fast.draft.model.fused_ops is not None and ref.draft.model.fused_ops is None
    assert fast.draft.layers[0].q_norm is not None  # the kernel's q/k norms are exercised
    features = fast.target.fork().forward(fill_ids(300, fast.target.config.vocab_size)).features
    for rt in (fast, ref):
        rt.draft.add_context(features)
    for size in (2, 5, 8):  # up to the draft's own block
        torch.testing.assert_close(fast.draft.propose(7, size=size), ref.draft.propose(7, size=size),
                                   rtol=0, atol=1e-4)
