"""The context lookup mixed into the draft's proposals (decoding/lookup.py): its guesses, when they replace
the draft's own token, and that decoding stays lossless with it (T=0 here; T>0: test_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from hetero_sd.decoding.lookup import ContextLookup

from .doubles import with_draft
from .test_lossless import MAX_NEW, PROMPTS, baselines  # noqa: F401 (the fixture)


def test_the_guess_is_what_followed_the_latest_earlier_occurrence_of_the_longest_match():
    seen = ContextLookup([1, 2, 9, 5, 1, 2, 7, 6, 1, 2])
    assert seen.guess() == 7  # (1, 2) was followed by 9, then by 7: the latest wins
    seen = ContextLookup([4, 1, 2, 9, 3, 1, 2, 7, 4, 1, 2])
    assert seen.guess() == 9  # the 3-gram (4, 1, 2) was followed by 9, though (1, 2) last by 7
    assert ContextLookup([1, 2, 3]).guess() is None  # no earlier occurrence of (2, 3) or (1, 2, 3)
    assert ContextLookup([5, 1, 5, 2]).guess() is None  # a 1-token match is not used
    seen = ContextLookup([1, 2, 9, 8])
    assert seen.guess(drafted=[1, 2]) == 9  # drafted tokens extend the context they are guessed after
    seen.extend([1, 2, 3])
    assert seen.guess() is None and seen.guess(drafted=[1, 2]) == 3


def test_a_guess_replaces_the_drafts_token_only_where_the_draft_is_unsure():
    seen = ContextLookup([1, 2, 9, 8, 1, 2], weight=0.4)
    sure = torch.full((1, 12), -10.0)
    sure[0, 5] = 5.0  # q(5) ~ 1: the guess 9 would need 0.6 q(9) + 0.4 > 0.6 q(5)
    assert seen.steer(sure, [5]) == [5] and seen.steered == 0
    unsure = torch.zeros(1, 12)
    unsure[0, 5] = 1.0  # q(5) ~ 0.2, q(9) ~ 0.07
    assert seen.steer(unsure, [5]) == [9] and seen.steered == 1
    assert ContextLookup([1, 2, 9, 8, 1, 2], weight=0.0).steer(unsure, [5]) == [5]
    # row 1's guess follows row 0's proposal: after (2, 9) came 8
    assert seen.steer(torch.zeros(2, 12), [5, 5]) == [9, 8]


def test_mixed_proposals_put_the_weight_on_the_guess():
    seen = ContextLookup([1, 2, 9, 8, 1, 2], weight=0.25)
    q = torch.softmax(torch.randn(2, 12, generator=torch.Generator().manual_seed(0)), -1)
    tokens, mixed = seen.mix(q, lambda probs, i: int(probs[0].argmax()))
    assert torch.allclose(mixed.sum(-1), torch.ones(2))
    assert mixed[0, 9] == pytest.approx(0.75 * q[0, 9].item() + 0.25)
    assert torch.allclose(mixed[0, :9], 0.75 * q[0, :9])
    assert torch.equal(q, torch.softmax(torch.randn(2, 12, generator=torch.Generator().manual_seed(0)), -1))  # q untouched


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
def test_decoding_with_a_strong_lookup_stays_lossless(smollm_random, baselines, schedule):  # noqa: F811
    """A random draft is unsure everywhere, so at weight 0.9 every guess the lookup has replaces its token:
    the target still emits exactly its own greedy tokens (and a repetitive answer gives the lookup guesses)."""
    rt = with_draft(smollm_random, smollm_random.draft, schedule)
    for prompt in PROMPTS[:2]:
        spec = rt.generate(prompt, max_new_tokens=MAX_NEW, lookup=0.9)
        assert spec.token_ids == baselines[prompt].token_ids
        assert spec.stats.lookup_weight == 0.9
    off = rt.generate(PROMPTS[0], max_new_tokens=MAX_NEW, lookup=0)
    assert off.token_ids == baselines[PROMPTS[0]].token_ids and off.stats.lookup_drafts == 0
    repeated = "Say 'one two three' five times: one two three, one two three,"
    base = smollm_random.generate(repeated, max_new_tokens=MAX_NEW, speculative=False)
    spec = rt.generate(repeated, max_new_tokens=MAX_NEW, lookup=0.9)
    assert spec.token_ids == base.token_ids and spec.stats.lookup_drafts > 0


def test_a_bad_lookup_weight_is_refused_with_the_fix(smollm_random):
    from hetero_sd.errors import InvalidArgumentError

    for bad in (1.0, -0.1, "0.4", True):
        with pytest.raises(InvalidArgumentError, match="lookup weight"):
            list(smollm_random.stream("hi", max_new_tokens=2, lookup=bad))


def force_lookup_blocks(monkeypatch, draft_blocks: int = 0):
    """The controller takes a lookup block wherever the text repeats and the lookup has a guess; with
    draft_blocks=b, a draft block of b everywhere else and after every lookup block (never plain)."""
    from hetero_sd.decoding.controller import AutoBlock

    def lookup_block(self, speeds):
        guesses = self.lookup.chain(self.max_size - 1) if self.lookup is not None and self.repeats.last else []
        if draft_blocks and self.via_lookup_last:
            guesses = []
        self.via_lookup_last = bool(guesses)
        return len(guesses) + 1 if guesses else 0
    monkeypatch.setattr(AutoBlock, "via_lookup_last", False, raising=False)
    monkeypatch.setattr(AutoBlock, "best_lookup", lookup_block)
    if draft_blocks:
        monkeypatch.setattr(AutoBlock, "best", lambda self: draft_blocks)


@pytest.mark.slow
def test_lookup_blocks_stay_lossless(smollm_random, baselines, monkeypatch):  # noqa: F811
    """Blocks of the lookup's guesses alone (no draft pass) between draft blocks and plain steps: the draft's
    context catches up on every position a lookup block verified, and the output is the target's own."""
    import hetero_sd

    force_lookup_blocks(monkeypatch, draft_blocks=4)
    rt = hetero_sd.load("default", "random", block_size="auto")
    repeated = "Say 'one two three' five times: one two three, one two three,"
    base = smollm_random.generate(repeated, max_new_tokens=MAX_NEW, speculative=False)
    for prompt, want in [(repeated, base.token_ids), (PROMPTS[0], baselines[PROMPTS[0]].token_ids)]:
        spec = rt.generate(prompt, max_new_tokens=MAX_NEW)
        assert spec.token_ids == want
    spec = rt.generate(repeated, max_new_tokens=MAX_NEW)
    assert spec.token_ids == base.token_ids and 0 < spec.stats.lookup_blocks < spec.stats.num_drafts


def test_the_controller_takes_a_lookup_block_where_it_is_cheaper_and_as_right():
    from hetero_sd.decoding.controller import AutoBlock, Memory
    from hetero_sd.decoding.costs import Costs

    costs = Costs(decode_s=1.0, verify_s={1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}, draft_s={2: 0.4, 4: 0.5, 8: 0.6})
    seen = ContextLookup([1, 2, 3, 4, 1, 2, 3])
    policy = AutoBlock(8, Memory(costs, 8, learn_costs=False), [1, 2, 3, 4, 1, 2, 3], lookup=seen)
    policy.emitted([4])  # (the loop tells both)
    seen.extend([4])
    for _ in range(20):  # the draft is right at every position: long blocks pay
        policy.observe(8, 7, 7, 1.0)
    # the guesses 1, 2, 3, 4, ... (the cycle goes on): a block of 8 without the draft pass beats the draft's
    assert policy.repeats.last and policy.best_lookup(policy.speeds()) == 8
    assert policy.choose() >= 2 and policy.via_lookup and policy.lookup_blocks == 1
    policy.block_run = policy.PLAIN_CHECK_AFTER + 1  # a plain check falls due: it wins, and is not a lookup block
    assert policy.choose() == 1 and not policy.via_lookup and policy.lookup_blocks == 1
    policy.repeats.last = False  # no repeat at the anchor: no lookup block
    assert policy.best_lookup(policy.speeds()) == 0
