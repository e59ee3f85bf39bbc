"""Targets on the mlx device through mlx-lm's own model classes (backends/hf_backend/mlxlm_target.py):
families our MLX layers do not implement (qwen3_moe; qwen3_next: Gated DeltaNet, whose recurrent caches
roll back by restoring the block's start state) and an mlx-lm 4-bit quantized model, each greedy
identical to mlx-lm's own generate_step, autoregressively and speculatively (fixed block: rejections at
every position; torch and MLX drafts). Skipped where mlx or mlx-lm is not installed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import hetero_sd  # noqa: E402
from hetero_sd.backends.hf_backend import legacy_keys  # noqa: E402

from .conftest import make_tiny_target  # noqa: E402
from .doubles import OracleDraft, with_draft  # noqa: E402

PROMPT, NEW, VOCAB = [5, 9, 17, 33, 2, 8, 100, 7, 44, 3, 12, 90], 16, 256
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              shared_expert_intermediate_size=32, **MOE)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def mlx_lm_greedy(folder, prompt, new: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(folder, model_config=legacy_keys(json.loads((folder / "config.json").read_text())))
    steps = generate_step(mx.array(prompt), model, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in (next(steps) for _ in range(new))]


def quantized_copy(folder, out, bits: int = 4, group: int = 32):
    """The model as mlx-lm quantizes it (what mlx-community publishes), with the tokenizer beside it."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(folder, model_config=legacy_keys(json.loads((folder / "config.json").read_text())))
    model, config = quantize_model(model, config, group, bits)
    out.mkdir()
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlxlm")
    moe = make_tiny_target(root / "moe", "qwen3_moe", vocab_size=VOCAB, intermediate_size=64, **MOE)
    hybrid = make_tiny_target(root / "next", "qwen3_next", vocab_size=VOCAB, **HYBRID)
    return {"qwen3_moe": moe, "qwen3_moe-4bit": quantized_copy(moe, root / "moe-4bit"), "qwen3_next": hybrid}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe-4bit", "qwen3_next"])
@pytest.mark.parametrize("draft_device", ["cpu", "mlx"])
def test_greedy_equals_mlx_lm(models, name, draft_device):
    folder = models[name]
    reference = mlx_lm_greedy(folder, PROMPT, NEW)
    rt = hetero_sd.load(str(folder), "random:1", target_device="mlx", draft_device=draft_device, block_size=4)
    assert any("runs through mlx-lm" in n for n in rt.info["notes"])
    if name.endswith("4bit"):
        assert any("4-bit, group 32" in n for n in rt.info["notes"])
    assert rt.generate(PROMPT, max_new_tokens=NEW, speculative=False).token_ids == reference
    spec = rt.generate(PROMPT, max_new_tokens=NEW)
    assert spec.token_ids == reference and spec.stats.num_drafts > 0
    oracle = OracleDraft(PROMPT + reference, 4, VOCAB, right=lambda position: position % 5 != 0)
    cut = with_draft(rt, oracle).generate(PROMPT, max_new_tokens=NEW)
    assert cut.token_ids == reference and len(set(cut.stats.accepted_per_step)) >= 3  # cut at several positions


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next"])
def test_the_prefix_cache_keeps_the_output_on_mlx(models, name):
    rt = hetero_sd.load(str(models[name]), "random:1", target_device="mlx", draft_device="cpu", block_size=4)
    first = rt.generate(PROMPT, max_new_tokens=8).token_ids
    turns = [PROMPT, PROMPT + first[:5] + [7, 8]]
    fresh = [rt.generate(p, max_new_tokens=8).token_ids for p in turns]
    rt.prefix_cache = True
    cached = [rt.generate(p, max_new_tokens=8) for p in turns]
    assert [g.token_ids for g in cached] == fresh and cached[1].stats.num_cached_tokens > 0
