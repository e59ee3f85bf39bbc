"""Targets run by transformers' own model classes (backends/hf_backend): hybrid Gated DeltaNet
(qwen3_5_text, qwen3_next), MoE (qwen3_moe, gpt_oss, qwen3_next) and sliding-window (gpt_oss,
gemma4_text), each a tiny random model built here, with a random z-lab-format draft.

At temperature 0 the output must equal transformers' own greedy `generate`, autoregressively and
speculatively, with rejections at every block position (the recurrent layers' rollback re-runs the
accepted prefix from the block's start state) and under the block-size controller. At T > 0 a
chi-square test on the hybrid."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
from hetero_sd.decoding.controller import PLAIN, Memory
from hetero_sd.decoding.costs import Costs
from hetero_sd.decoding.sampling import SamplingParams
from hetero_sd.models.draft_init import random_draft_tensors, write_draft
from hetero_sd.models.hf_config import hf_arch
from hetero_sd.models.config import read_json
from hetero_sd.models.draft_init import draft_config

from .conftest import make_tiny_target
from .doubles import OracleDraft, with_draft

LINEAR = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)
FAMILIES = {
    "qwen3_5_text": dict(layer_types=LINEAR, **GDN),  # hybrid: 3 Gated DeltaNet layers, 1 attention layer
    "qwen3_next": dict(layer_types=LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, **GDN),  # hybrid and MoE
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"] * 2),  # MoE, sinks, window 6 < the text
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma4_text": dict(sliding_window=6, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
}
VOCAB, BLOCK, NEW = 256, 4, 20
PROMPT = [5, 9, 17, 33, 2, 8, 100, 7, 44, 3, 12, 90]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one torch thread is fastest, and immune to other jobs on the cores (restored by conftest)."""
    torch.set_num_threads(1)


def make_pair(root, model_type: str, vocab: int = VOCAB, seed: int = 0, block: int = BLOCK, **extra):
    target = make_tiny_target(root / model_type, model_type, vocab_size=vocab, seed=seed,
                              **{**FAMILIES[model_type], **extra})
    cfg = hf_arch(read_json(target / "config.json"))
    raw = draft_config(cfg, num_layers=1, block_size=block, mask_token_id=3, layer_ids=[0, 2, 3])
    draft = write_draft(root / f"{model_type}-draft", raw, random_draft_tensors(raw, seed=seed + 1, std=0.2),
                        dtype=torch.float32)
    return target, draft


def greedy_reference(folder, prompt, new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # raw ids: no stop at EOS, as generate(list) does
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    torch.set_num_threads(1)
    target, draft = make_pair(tmp_path_factory.mktemp("fam"), request.param)
    rt = hetero_sd.load(str(target), str(draft), block_size="fixed")
    return request.param, rt, greedy_reference(target, PROMPT, NEW)


def test_greedy_equals_transformers_autoregressive_and_speculative(family):
    name, rt, reference = family
    assert rt.info["target_path"] == "transformers"
    assert any(f"target {name} runs through transformers" in n for n in rt.info["notes"])
    plain = rt.generate(PROMPT, max_new_tokens=NEW, speculative=False)
    assert plain.token_ids == reference
    spec = rt.generate(PROMPT, max_new_tokens=NEW)
    assert spec.stats.mode == "speculative" and spec.stats.num_drafts > 0
    assert spec.token_ids == reference


def test_rejections_at_every_block_position_keep_the_output(family):
    """An oracle draft right except at every 5th position: blocks accept 0, 1, 2 or all 3 drafts, so
    the cache is cut back at every position of the block (for recurrent layers: a rollback)."""
    name, rt, reference = family
    oracle = OracleDraft(PROMPT + reference, BLOCK, VOCAB, right=lambda position: position % 5 != 0)
    spec = with_draft(rt, oracle).generate(PROMPT, max_new_tokens=NEW)
    assert spec.token_ids == reference
    assert {0, 1, 2, 3} <= set(spec.stats.accepted_per_step)
    assert rt.target.recomputes == 0  # every cut fell inside the last block: no re-run from position 0


def test_the_controller_switching_plain_and_blocks_keeps_the_output(family):
    name, rt, reference = family
    oracle = OracleDraft(PROMPT + reference, BLOCK, VOCAB, right=lambda position: 20 <= position < 27)
    decode = 0.01  # given costs, never learnt: the choices depend on acceptance alone
    costs = Costs(decode_s=decode, verify_s={k: decode * (1 + 0.03 * k) for k in (2, 3, 4)},
                  draft_s={b: 0.001 * b for b in (2, 3, 4)})
    out = with_draft(rt, oracle, "sequential", "auto", Memory(costs, BLOCK, learn_costs=False)).generate(
        PROMPT, max_new_tokens=NEW)
    assert out.token_ids == reference
    hist = out.stats.block_size_histogram
    assert hist[PLAIN] == out.stats.plain_steps > 0 and any(hist[b] for b in (2, 3, 4))  # both modes ran


def test_hybrid_under_measured_costs_and_two_requests_at_once(tmp_path):
    """block_size='auto' as a user gets it: the cost probe runs through the hybrid's rollback; then two
    requests in flight (forked caches over the same weights) each equal their own run alone."""
    target, draft = make_pair(tmp_path, "qwen3_5_text")
    rt = hetero_sd.load(str(target), str(draft))
    assert rt.info["block"] == "auto"
    prompts = [PROMPT, PROMPT[::-1]]
    alone = [rt.generate(p, max_new_tokens=12, speculative=False).token_ids for p in prompts]
    assert alone[0] == greedy_reference(target, PROMPT, 12)
    assert rt.generate(PROMPT, max_new_tokens=12).token_ids == alone[0]
    both = rt.generate_many(prompts, max_new_tokens=12, schedule="pipeline")
    assert [g.token_ids for g in both] == alone


def test_a_random_draft_is_built_from_the_target_config(tmp_path):
    target, _ = make_pair(tmp_path, "gpt_oss")
    rt = hetero_sd.load(str(target), "random:1", block_size=4)
    assert rt.info["target_layer_ids"] and rt.draft.block_size == 4
    assert rt.generate(PROMPT, max_new_tokens=6).token_ids == greedy_reference(target, PROMPT, 6)


def test_features_match_the_fast_path_on_qwen3(tiny_qwen3):
    """The same qwen3 model through both paths: equal logits and context features (layer i's output,
    the last layer's after the final norm) -- the feature layout the draft was trained on."""
    from hetero_sd.loading.families import FAST, TRANSFORMERS, load_target, target_config

    cfg, path = target_config(tiny_qwen3)
    assert path == FAST
    ids = [5, 9, 12, 20, 7, 33, 2, 14]
    outs = []
    for p in (FAST, TRANSFORMERS):
        t = load_target(tiny_qwen3, cfg, p, "cpu", "float32", [0, 2, 3], None, [])
        first = t.forward(ids[:5])
        t.crop(3)
        rest = t.forward(ids[3:])
        outs.append((first, rest))
    (fast_first, fast_rest), (hf_first, hf_rest) = outs
    for a, b in ((fast_first, hf_first), (fast_rest, hf_rest)):
        assert torch.allclose(a.logits, b.logits, atol=1e-4)
        assert torch.allclose(a.features.float(), b.features.float(), atol=1e-4)


def test_chi_square_on_the_hybrid(tmp_path):
    """T = 1 with the rejection rule: emitted tokens follow the hybrid target's own distribution."""
    from .test_sampling import chi_square_p

    vocab, prompt, steps, n = 8, [2, 5, 6, 4], 2, 600
    target, draft = make_pair(tmp_path, "qwen3_5_text", vocab=vocab, seed=3, block=3, initializer_range=0.35)
    rt = hetero_sd.load(str(target), str(draft), block_size="fixed")
    samples, accepted, drafted = [], 0, 0
    for seed in range(n):
        g = rt.generate(prompt, max_new_tokens=steps, temperature=1.0, seed=seed, rule="rejection")
        samples.append(tuple(g.token_ids))
        accepted, drafted = accepted + g.stats.num_accepted_tokens, drafted + g.stats.num_draft_tokens
    assert 0 < accepted < drafted  # both branches of the rule ran
    p = chi_square_p(samples, exact_joint(target, prompt, vocab, steps, SamplingParams(1.0)))
    assert p > 1e-3, f"samples do not follow the hybrid target's distribution (chi-square p = {p:.2e})"


def exact_joint(folder, prompt, vocab: int, steps: int, params: SamplingParams) -> dict[tuple, float]:
    from transformers import AutoModelForCausalLM

    from hetero_sd.decoding.sampling import Sampler

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    probs = Sampler(params).probs
    joint = {(): 1.0}
    for _ in range(steps):
        prefixes = list(joint)
        with torch.no_grad():
            p = probs(model(torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1]).double()
        joint = {pre + (t,): joint[pre] * p[i, t].item() for i, pre in enumerate(prefixes) for t in range(vocab)}
    return joint


def test_a_multimodal_qwen3_5_checkpoint_runs_its_language_model(tmp_path):
    """Published Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration (model_type qwen3_5, the decoder
    under text_config, vision weights beside it): the target is its language model, greedy-identical to
    the whole model's own generate."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from .conftest import tiny_tokenizer

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, eos_token_id=1, initializer_range=0.2,
                max_position_embeddings=512, **FAMILIES["qwen3_5_text"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(str(tmp_path))
    tiny_tokenizer(tmp_path, VOCAB)
    rt = hetero_sd.load(str(tmp_path), "random:1", block_size=4)
    assert rt.info["target_path"] == "transformers" and rt.target.config.hidden_size == 64
    model.generation_config.eos_token_id = None
    reference = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
    assert rt.generate(PROMPT, max_new_tokens=12, speculative=False).token_ids == reference
    assert rt.generate(PROMPT, max_new_tokens=12).token_ids == reference


def test_hooked_features_equal_output_hidden_states(family):
    """The hooks record exactly the output_hidden_states entries the draft reads (i + 1 for layer i; the
    last after the final norm), in every family."""
    name, rt, _ = family
    target = rt.target.fork()
    assert target.capture.ok
    out = target.forward(PROMPT)
    with torch.no_grad():
        states = target.model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i + 1][0] for i in target.layer_ids], dim=-1)
    assert target.layer_ids[-1] == target.config.num_hidden_layers - 1  # the final-norm case is covered
    assert torch.equal(out.features, expected)


def test_the_prefix_cache_keeps_the_output(family):
    """A next turn reuses the caches of the longest shared prefix (the runtime's prefix cache): the cut
    lands before the last forward, so sliding-window and recurrent caches re-run the prefix from position
    0 and full-attention caches are cut in place; the tokens are the same either way."""
    name, rt, reference = family
    turns = [PROMPT, PROMPT + reference[:6] + [7, 8]]
    fresh = [rt.generate(p, max_new_tokens=8).token_ids for p in turns]
    rt.prefix_cache = True
    try:
        cached = [rt.generate(p, max_new_tokens=8) for p in turns]
    finally:
        rt.prefix_cache = False
    assert [g.token_ids for g in cached] == fresh
    assert cached[1].stats.num_cached_tokens > 0
