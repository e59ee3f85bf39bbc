"""The int8-row kernel (backends/torch_backend/quant8.py, `--dtype int8`): x is quantized per block of 32
to int8 as llama.cpp's Q8_1 (round to nearest even) and multiplied by the GGUF blocks in integer dot
products. It equals a float64 matmul of those quantized rows and the dequantized blocks within float32
rounding; a row gives bitwise the same result alone or in any block of rows, on either ISA; and the
int8 default target decodes losslessly with DFlash (its own baseline), said in stats and notes."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
from hetero_sd.backends.torch_backend import fused, quant, quant8
from hetero_sd.backends.torch_backend.cpu import cpu_flags
from hetero_sd.errors import ConfigError

from .test_quant import ROWS, isa_switch, random_rows

pytestmark = pytest.mark.skipif(quant8.isa() is None, reason="no AVX512-VNNI nor AVX2+FMA+F16C on this CPU")

ISAS = ["avx2"] + (["avx512"] if {"avx512bw", "avx512_vnni"} <= cpu_flags() else [])


@pytest.fixture
def on_isa(monkeypatch):
    return isa_switch(monkeypatch, quant8)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: d = amax/127 per 32 inputs, codes x * (1/d) rounded to nearest even."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,n,k", [(quant.Q4_1, 77, 576), (quant.Q4_1, 33, 1536), (quant.Q8_0, 131, 64)])
def test_kernel_is_the_matmul_of_int8_rows_and_the_blocks(on_isa, isa, kind, n, k):
    on_isa(isa)
    rows = random_rows(kind, n, k)
    q = quant8.Int8Blocks(kind, rows, None)
    w = quant.dequantize(kind, rows).double()
    torch.manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k) * 2
        exact = int8_rows(x).double() @ w.t()
        assert (q(x).double() - exact).abs().max() <= 1e-5 * exact.abs().max(), m
        # and it is another function than the float32 target's: the rows were rounded to 8 bits
        assert (q(x).double() - x.double() @ w.t()).abs().max() > 1e-4 * exact.abs().max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", [quant.Q4_1, quant.Q8_0])
def test_a_row_is_bitwise_the_same_in_any_block_and_on_either_isa(on_isa, isa, kind):
    rows = random_rows(kind, 45, 576, seed=2)
    x = torch.randn(64, 576)
    on_isa(isa)
    q = quant8.Int8Blocks(kind, rows, None)
    full = q(x)
    for r in range(64):
        assert torch.equal(q(x[r:r + 1]), full[r:r + 1])
    for m in ROWS:
        assert torch.equal(q(x[:m]), full[:m])
    on_isa("avx2")
    assert torch.equal(quant8.Int8Blocks(kind, rows, None)(x[:9]), full[:9])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", [quant.Q4_1, quant.Q8_0])
def test_prefill_rows_take_the_int8_kernel_with_the_decode_rows_bits(on_isa, isa, kind):
    """A prompt longer than a verify block is multiplied by the int8 kernel too (llama.cpp quantizes
    its prompt's rows as well), not by the float32 fallback, and each of its rows has a decode row's bits; the
    AVX2 Q8_0 path takes 8 rows per tile, Q4_1 4: row counts around both (and odd tails) are covered."""
    rows = random_rows(kind, 24, 576, seed=3)
    on_isa(isa)
    q = quant8.Int8Blocks(kind, rows, lambda x: pytest.fail("the float32 fallback was called"))
    x = torch.randn(131, 576) * 3
    full = q(x)
    assert full.shape == (131, 24)
    for r in range(0, 131, 5):
        assert torch.equal(q(x[r:r + 1]), full[r:r + 1]), r
    for m in (4, 5, 8, 9, 12, 65, 100):
        assert torch.equal(q(x[:m]), full[:m]), m
        assert torch.equal(q(x[m:2 * m]), full[m:2 * m]), m


@pytest.mark.skipif(not {"amx_tile", "amx_int8", "avx512_vnni"} <= cpu_flags(), reason="no AMX-INT8 on this CPU")
@pytest.mark.parametrize("kind,n,k", [(quant.Q4_1, 77, 576), (quant.Q8_0, 40, 1536)])
def test_amx_tiles_give_bitwise_what_vnni_gives(monkeypatch, kind, n, k):
    """Verify blocks go through AMX tiles, decode rows through VNNI: the same integer sums and the same float
    epilogue, so a position's logits cannot depend on which path its row took."""
    rows = random_rows(kind, n, k, seed=5)
    x = torch.randn(40, k)
    vnni = quant8.Int8Blocks(kind, rows, None, amx=0)  # LoadPolicy.amx_rows
    amx = quant8.Int8Blocks(kind, rows, None, amx=2)
    assert amx.ext.amx_ready()
    for m in (2, 9, 16, 17, 40):
        assert torch.equal(amx(x[:m]), vnni(x[:m]))
    assert torch.equal(amx(x[:1]), vnni(x[:16])[:1])  # one row (VNNI) against its 16-row block (AMX)


def test_int8_needs_a_cpu_target_from_a_gguf(tiny_llama):
    with pytest.raises(ConfigError, match="converted from a Q4_1/Q8_0 GGUF"):
        hetero_sd.load(str(tiny_llama), None, dtype="int8")
    with pytest.raises(ConfigError, match="unknown dtype 'int4'"):
        hetero_sd.load(str(tiny_llama), None, dtype="int4")


@pytest.mark.slow
def test_int8_default_target_is_named_and_dflash_on_it_is_lossless(default_folder):
    rt = hetero_sd.load("default", "cpu-trained", dtype="int8", block_size=8)
    assert rt.info["target_dtype"] == "int8" and rt.info["target_weights"].endswith("x int8 rows")
    assert any("a different target from the float32 one" in n for n in rt.notes)
    assert isinstance(rt.target.mm_head, quant8.Int8Blocks)
    for prompt in ("Write a Python function that checks whether a number is prime.", "Explain what a hash table is."):
        base = rt.generate(prompt, max_new_tokens=64, speculative=False)
        out = rt.generate(prompt, max_new_tokens=64)
        assert out.token_ids == base.token_ids and out.stats.target_dtype == "int8"
    # decode and verify rows are bitwise the same through the whole target (the int8 codes would turn
    # any difference upstream into a different token)
    t = rt.target.fork()
    ids = rt.tokenizer.encode("Explain what a hash table is, in two sentences.")
    t.forward(ids[:-6], features=False)
    block = t.forward(ids[-6:], features=False).logits
    t.crop(len(ids) - 6)
    rows = torch.cat([t.forward([i], features=False).logits for i in ids[-6:]])
    assert torch.equal(block, rows)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["default", "float16"])
def test_int8_target_keeps_llama_cpp_kv_caches_and_stays_lossless(default_folder, kv):
    """The int8 target keeps V in float16 and K as q8_0 blocks where the CPU has AVX512-VNNI (llama.cpp's -ctk
    q8_0), else (or with HETERO_SD_KV=float16) in float16 as llama.cpp does by default; HETERO_SD_KV=float32 keeps
    both in float32. Decode and verify rows read the same stored values, so they still agree bit for bit, and
    DFlash on it is lossless."""
    from hetero_sd.backends.torch_backend.plan import Q8_K_FLAGS
    from hetero_sd.cli.policy import policy_from_env

    policy = policy_from_env({} if kv == "default" else {"HETERO_SD_KV": kv})
    q8 = kv == "default" and Q8_K_FLAGS <= cpu_flags()
    rt = hetero_sd.load("default", "cpu-trained", block_size=8, policy=policy)
    k_dtype = torch.uint8 if q8 else torch.float16
    assert rt.target.cache.k[0].dtype == k_dtype and rt.target.cache.v[0].dtype == torch.float16
    assert rt.draft.cache.k[0].dtype == torch.float32
    named = ("KV cache: K as q8_0 blocks", "q8_0 K + float16 V cache") if q8 else ("KV cache: float16", "float16 KV cache")
    assert any(n.startswith(named[0]) for n in rt.notes) and named[1] in rt.info["weight_plan"]
    t = rt.target.fork()
    assert t.cache.k[0].dtype == k_dtype
    ids = rt.tokenizer.encode("Explain what a hash table is, in two sentences.")
    t.forward(ids[:-6], features=False)
    block = t.forward(ids[-6:], features=False).logits
    t.crop(len(ids) - 6)
    assert torch.equal(block, torch.cat([t.forward([i], features=False).logits for i in ids[-6:]]))
    prompt = "Write a Python function that checks whether a number is prime."
    assert rt.generate(prompt, max_new_tokens=64).token_ids == \
        rt.generate(prompt, max_new_tokens=64, speculative=False).token_ids
    if kv == "default":
        f32 = hetero_sd.load("default", None, policy=policy_from_env({"HETERO_SD_KV": "float32"}))
        assert f32.target.cache.k[0].dtype == torch.float32 and not any(n.startswith("KV cache") for n in f32.notes)
        assert hetero_sd.load("default", None, dtype="float32").target.cache.k[0].dtype == torch.float32


@pytest.mark.slow
def test_the_default_target_and_draft_walk_their_layers_in_one_call(default_folder, monkeypatch):
    """The int8 default target (and its CPU draft's block) walk all layers in one C++ call (fused.py
    `layers`), named in the weight plan: bitwise the same logits, features and draft block, and the same tokens,
    as the same ops called layer by layer from Python (FusedLayerOps.stack=False: the walk the ops that `layers`
    does not take still run)."""
    rt = hetero_sd.load("default", "default", block_size=4)
    assert "one-call layer walk" in rt.info["weight_plan"]
    ext, calls = fused.extension(), []
    one_call = ext.layers
    monkeypatch.setattr(ext, "layers", lambda *a: calls.append(1) or one_call(*a))
    ids = rt.tokenizer.encode("Write a Python function that checks whether a number is prime.")
    prompt = "Explain what a hash table is."

    def run():
        t, d = rt.target.fork(), rt.draft.fork()
        prefill, verify = t.forward(ids), t.forward(ids[:5])
        d.add_context(torch.cat([prefill.features, verify.features]))
        return [prefill.logits, prefill.features, verify.logits, verify.features, d.propose(ids[5])], \
            rt.generate(prompt, max_new_tokens=48).token_ids

    one, one_tokens = run()
    assert calls
    monkeypatch.setattr(rt.target.ops, "stack", False)
    monkeypatch.setattr(rt.draft.model.fused_ops, "stack", False)
    calls.clear()
    walked, walked_tokens = run()
    assert not calls and all(torch.equal(a, b) for a, b in zip(one, walked)) and one_tokens == walked_tokens


@pytest.mark.slow
def test_a_gguf_target_on_the_cpu_is_int8_by_default_and_float32_on_request(default_folder, tiny_llama, monkeypatch):
    from hetero_sd.backends.policy import LoadPolicy

    assert hetero_sd.load("default", None).info["target_dtype"] == "int8"
    assert hetero_sd.load("default", None, dtype="float32").info["target_dtype"] == "float32"
    assert hetero_sd.load(str(tiny_llama), None).info["target_dtype"] == "float32"  # not from a GGUF
    # no GGUF blocks allowed by the policy: the float32 target (its own note names the policy)
    assert hetero_sd.load("default", None, policy=LoadPolicy(quant=False)).info["target_dtype"] == "float32"
    # a CPU without the kernel: float32, and the note says the default could not be had and why
    monkeypatch.setattr(quant8, "isa", lambda *a, **k: None)
    rt = hetero_sd.load("default", None)
    assert rt.info["target_dtype"] == "float32"
    assert any("not the default int8" in n and "AVX2+FMA+F16C" in n for n in rt.notes)


@pytest.mark.slow
def test_batched_int8_generation_gives_the_runtimes_own_greedy_answers(default_folder):
    """Data generation on the runtime's int8 plan and fused kernels: every matrix is int8 rows x GGUF blocks, a
    prompt is prefilled alone into its slot, and a decode step is one call for all slots (rope_slots,
    attend_slots); the answers are token for token the runtime's own greedy answers (2 slots for 5 prompts:
    slots are refilled mid-run, rows decode beside rows at other positions)."""
    from hetero_sd.train.batched import BatchedGenerator
    from hetero_sd.train.distill import chat_ids

    rt = hetero_sd.load("default", None)
    gen = BatchedGenerator(default_folder, slots=2, max_new_tokens=24, max_prompt_tokens=48,
                           stop_ids=rt.stop_ids, numerics="int8")
    assert isinstance(gen.model.mm_head, quant8.Int8Blocks)
    assert all(isinstance(getattr(b, a), quant8.Int8Blocks) for b in gen.model.layers
               for a in ("mm_qkv", "mm_o", "mm_gate_up", "mm_down"))
    if not gen.fused:
        assert gen.notes and "torch's ops" in gen.notes[0]
        pytest.skip("the fused C++ attention is not available on this CPU (announced in gen.notes)")
    assert gen.kv_dtype == rt.target.cache.dtype and gen.notes == []
    assert gen.k_q8 == rt.target.cache.k_q8 and gen.k_dtype == rt.target.cache.k[0].dtype  # the runtime's K cache
    assert not BatchedGenerator(default_folder, slots=2, numerics="int8", k_q8=False).k_q8  # (HETERO_SD_KV=float16)
    texts = ("The capital of France is", "def add(a, b):", "Water boils at", "Name three colors.", "Say hi.")
    prompts = [(str(i), chat_ids(rt.tokenizer, t)) for i, t in enumerate(texts)]
    answers = {a.key: a for a in gen.generate(prompts)}
    assert sorted(answers) == [k for k, _ in prompts]
    for key, ids in prompts:
        ref = rt.generate(ids, max_new_tokens=24, stop_at_eos=True).token_ids
        assert answers[key].response_ids == ref, key
        assert answers[key].finished == (ref[-1] in rt.stop_ids)

@pytest.mark.slow
def test_training_features_of_the_int8_target(default_folder, tmp_path):
    """--feature-numerics int8: the trainer's features come from the runtime's default CPU target (int8 rows x
    the GGUF blocks), close to the float32 target's (a draft reads them alike on held-out answers)
    but not the same numbers; a store on disk names the target's K cache when it is q8_0 blocks."""
    import json

    from hetero_sd.train.trainer import FeatureCache

    ids = list(range(1000, 1040))
    got = {n: FeatureCache(default_folder, [1, 8], budget_bytes=0, numerics=n) for n in ("float32", "int8")}
    assert got["int8"].target.numerics == "int8" and got["float32"].target.numerics == "float32"
    a, b = (got[n].compute(ids)[0].float() for n in ("float32", "int8"))
    assert a.shape == b.shape == (40, 2 * 576) and not torch.equal(a, b)
    assert (a - b).norm() < 0.05 * a.norm()
    on_disk = FeatureCache(default_folder, [1, 8], budget_bytes=0, numerics="int8", disk=tmp_path / "f")
    kind = "int8, q8_0 K" if on_disk.target.cache.k_q8 else "int8"
    assert on_disk.kind == kind and json.loads((tmp_path / "f" / "manifest.json").read_text())["numerics"] == kind
    # HETERO_SD_KV=float16 (train-draft passes k_q8=False down): a float16 K cache, a store of its own kind
    f16 = FeatureCache(default_folder, [1, 8], budget_bytes=0, numerics="int8", k_q8=False, disk=tmp_path / "g")
    assert not f16.target.cache.k_q8 and f16.kind == "int8"
    if kind != "int8":
        from hetero_sd.errors import ConfigError
        with pytest.raises(ConfigError, match="made differently"):
            FeatureCache(default_folder, [1, 8], budget_bytes=0, numerics="int8", disk=tmp_path / "g")
    # --cache-features names its store as the trainer's FeatureCache does (it once named it "int8" whatever the K)
    import argparse
    from hetero_sd.train.command import cache_features
    rows = [{"index": 0, "key": "k0", "prompt_ids": [5, 6, 7], "response_ids": list(range(1000, 1008))}]
    cache_features(default_folder, rows, argparse.Namespace(layers=2, device="cpu", feature_cache=str(tmp_path / "h"),
                                                            feature_numerics="int8", init_from=None))
    assert json.loads((tmp_path / "h" / "manifest.json").read_text())["numerics"] == kind
