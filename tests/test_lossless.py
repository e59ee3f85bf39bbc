"""Temperature 0: speculative decoding must emit exactly the target's own greedy tokens."""

from __future__ import annotations

import pytest
import torch

from hetero_sd.decoding import loop
from hetero_sd.decoding.sampling import Verdict

from .doubles import OracleDraft, with_draft

PROMPTS = ["Write a haiku about the sea.", "What is 12 times 7?",
           "Give three tips for learning Python.", "Explain photosynthesis briefly."]
MAX_NEW = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def baselines(smollm_random):
    return {p: smollm_random.generate(p, max_new_tokens=MAX_NEW, speculative=False) for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_random_draft_is_lossless(smollm_random, baselines, prompt):
    spec = smollm_random.generate(prompt, max_new_tokens=MAX_NEW)
    assert spec.stats.mode == "speculative" and spec.stats.num_drafts > 0
    assert spec.token_ids == baselines[prompt].token_ids
    assert spec.text == baselines[prompt].text


# prompts whose answers run past one block (the int8 default answers "What is 12 times 7?" in 11 tokens)
@pytest.mark.parametrize("prompt", PROMPTS[::2])
def test_oracle_draft_accepts_full_blocks_and_stays_lossless(smollm_random, prompt):
    # past EOS: MAX_NEW tokens whatever the answer's length, so that several whole blocks are drafted
    base = smollm_random.generate(prompt, max_new_tokens=MAX_NEW, speculative=False, stop_at_eos=False)
    vocab = smollm_random.target.config.vocab_size
    oracle = OracleDraft(base.prompt_ids + base.token_ids, 16, vocab)
    spec = with_draft(smollm_random, oracle).generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert spec.token_ids == base.token_ids
    # every step but the last accepts the whole block and adds the bonus token
    assert spec.stats.accepted_per_step[:-1] == [15] * (len(spec.stats.accepted_per_step) - 1)
    assert spec.stats.acceptance_length_histogram[16] >= 1
    assert spec.stats.num_drafts == -(-(len(base.token_ids) - 1) // 16)


def test_partially_right_draft_accepts_exactly_the_right_prefix(smollm_random, baselines):
    prompt = PROMPTS[2]
    base = baselines[prompt]
    oracle = OracleDraft(base.prompt_ids + base.token_ids, 16, smollm_random.target.config.vocab_size, correct=5)
    spec = with_draft(smollm_random, oracle).generate(prompt, max_new_tokens=MAX_NEW)
    assert spec.token_ids == base.token_ids
    assert set(spec.stats.accepted_per_step[:-1]) == {5}
    assert spec.stats.tau == pytest.approx(6.0, abs=1.0)


def test_the_comparison_catches_a_broken_verifier(smollm_random, baselines, monkeypatch):
    """Mutation check: a verifier that accepts every draft must break equality with the baseline."""
    def accept_all(sampler, target_logits, drafted, q, rule):
        return Verdict(len(drafted), drafted + sampler.sample(target_logits[-1:]))

    monkeypatch.setattr(loop, "verify", accept_all)
    prompt = PROMPTS[0]
    spec = smollm_random.generate(prompt, max_new_tokens=MAX_NEW)
    assert spec.token_ids != baselines[prompt].token_ids


def test_seeded_sampling_is_reproducible(smollm_random):
    runs = [smollm_random.generate(PROMPTS[1], max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids


def test_raw_ids_skip_chat_template_and_eos(smollm_random):
    ids = smollm_random.tokenizer.encode("The capital of France is")
    out = smollm_random.generate(ids, max_new_tokens=12)
    assert out.prompt_ids == ids
    assert len(out.token_ids) == 12 and out.stats.finish_reason == "length"


class UnsureOracle(OracleDraft):
    """Right everywhere, but unsure (a flat row: probability 1/vocab) of its 4th draft in every block."""

    def propose(self, anchor, position=None, size=None):
        logits = super().propose(anchor, position, size)
        if logits.shape[0] > 3:
            logits[3] = 0.0
        return logits


@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
def test_the_verify_gate_cuts_blocks_at_the_first_unsure_draft_and_stays_lossless(smollm_random, baselines, schedule):
    prompt = PROMPTS[2]
    base = baselines[prompt]
    oracle = UnsureOracle(base.prompt_ids + base.token_ids, 16, smollm_random.target.config.vocab_size)
    rt = with_draft(smollm_random, oracle, schedule)
    spec = rt.generate(prompt, max_new_tokens=MAX_NEW, verify_gate=0.3)
    assert spec.token_ids == base.token_ids
    # every block but the last is verified up to its unsure 4th draft: 3 drafts checked and accepted
    assert set(spec.stats.accepted_per_step[:-1]) == {3} and set(spec.stats.drafted_per_step[:-1]) == {3}
    assert spec.stats.gated_drafts >= 12 * (spec.stats.num_drafts - 1)
    ungated = rt.generate(prompt, max_new_tokens=MAX_NEW)  # the same draft without a gate: whole blocks verified
    assert ungated.token_ids == base.token_ids and ungated.stats.gated_drafts == 0
    assert set(ungated.stats.drafted_per_step[:-1]) == {15} and set(ungated.stats.accepted_per_step[:-1]) == {3}
