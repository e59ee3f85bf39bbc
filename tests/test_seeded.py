"""Seeded sampling is a function of (seed, position): the same output whatever block sizes are chosen,
and under the point-mass `match` rule the same tokens as seeded autoregressive sampling."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
from hetero_sd.decoding.controller import Memory
from hetero_sd.decoding.sampling import Sampler, SamplingParams

from .doubles import OracleDraft, with_draft
from .test_controller import cpu_like_costs

PROMPT = [5, 9, 12, 20, 7, 33, 2, 14]
N = 48
KW = dict(max_new_tokens=N, temperature=0.9, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def setup(tiny_llama):
    rt = hetero_sd.load(str(tiny_llama), "random:1", block_size="fixed")
    base = rt.generate(PROMPT, speculative=False, **KW)
    assert len(set(base.token_ids)) > 5  # really sampled, not one token repeated
    return rt, base


def oracle(rt, base, right=None):
    return OracleDraft(base.prompt_ids + base.token_ids, rt.draft.block_size, rt.target.config.vocab_size,
                       right=right)


def test_seeded_autoregressive_sampling_is_reproducible_and_depends_on_the_seed(setup):
    rt, base = setup
    assert rt.generate(PROMPT, speculative=False, **KW).token_ids == base.token_ids
    other = rt.generate(PROMPT, speculative=False, **{**KW, "seed": 12})
    assert other.token_ids != base.token_ids


@pytest.mark.parametrize("block", [2, 3, 5, "fixed"])
def test_match_at_any_fixed_block_equals_seeded_autoregressive(setup, block):
    """A draft right on stretches: blocks accept several tokens, reject others; the output is AR's."""
    rt, base = setup
    spec = with_draft(rt, oracle(rt, base, right=lambda p: p % 7 != 3)).generate(PROMPT, block=block, **KW)
    assert spec.stats.num_accepted_tokens > 0 and spec.stats.num_drafts > 0
    assert spec.token_ids == base.token_ids


def test_match_under_the_controller_equals_autoregressive_across_10_runs(setup):
    """10 runs under the controller, each with a different start for its acceptance prior and so
    different block choices: all equal seeded autoregressive sampling."""
    rt, base = setup
    outputs, choices = set(), set()
    for run in range(10):
        memory = Memory(cpu_like_costs(draft_per_row=0.001 * (1 + run)), rt.draft.block_size, learn_costs=False)
        right = (lambda p, r=run: (p + r) % 6 != 0)
        g = with_draft(rt, oracle(rt, base, right), "sequential", "auto", memory).generate(PROMPT, **KW)
        outputs.add(tuple(g.token_ids))
        choices.add(tuple(g.stats.drafted_per_step))
    assert outputs == {tuple(base.token_ids)}
    assert len(choices) > 1, "the runs should have chosen different blocks"


def test_random_draft_output_is_the_same_whatever_the_block(setup):
    """The untrained draft under `match`: every block size gives seeded autoregressive's tokens. (Under
    `rejection` the output is a sample of the same distribution but depends on the draft's proposals,
    which depend on where blocks start: reproducible per seed and block choice, not across them.)"""
    rt, base = setup
    short = {**KW, "max_new_tokens": 16}
    outs = {tuple(rt.generate(PROMPT, block=b, **short).token_ids) for b in (2, 6)}
    assert outs == {tuple(base.token_ids[:16])}
    again = [rt.generate(PROMPT, block=3, rule="rejection", **short).token_ids for _ in range(2)]
    assert again[0] == again[1]


def test_draws_are_keyed_by_position_not_by_call_order():
    s = Sampler(SamplingParams(1.0), seed=5)
    probs = torch.full((4, 50), 1 / 50)
    block = s.at(10).draw(probs, 0).tolist()
    singles = [s.at(10 + i).draw(probs[:1], 0).item() for i in range(4)]
    assert block == singles
    assert Sampler(SamplingParams(1.0), seed=6).at(10).draw(probs, 0).tolist() != block
    # a zero-probability token is never drawn
    p = torch.zeros(1, 8)
    p[0, 3] = p[0, 6] = 0.5
    assert {Sampler(SamplingParams(1.0), seed=k).at(0).draw(p, 0).item() for k in range(200)} == {3, 6}


def test_position_keyed_rejection_sampling_keeps_the_target_distribution():
    """The rejection rule with randomness keyed by (seed, position), in a loop that re-drafts the positions
    after a rejection (their keys are reused): the first two emitted tokens follow p0 x p1 exactly
    (chi-square over 2500 seeds; a correct sampler fails one time in a thousand)."""
    from collections import Counter

    import numpy as np
    from scipy.stats import chisquare

    from hetero_sd.decoding.sampling import draft_tokens, rejection

    g = torch.Generator().manual_seed(0)
    vocab = 3
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)  # the target at positions 0, 1, 2
    q = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)  # the draft's proposals there
    counts, n = Counter(), 2500
    for seed in range(n):
        sampler, out = Sampler(SamplingParams(1.0), seed), []
        while len(out) < 2:
            at = len(out)
            sampler.at(at)
            drafted, qq = draft_tokens(sampler, torch.log(q[at:2]), "rejection")
            out += rejection(sampler, p[at:at + len(drafted) + 1], drafted, qq).tokens
        counts[tuple(out[:2])] += 1
    joint = (p[0][:, None] * p[1][None, :]).double().numpy().ravel()
    observed = np.array([counts[(i, j)] for i in range(vocab) for j in range(vocab)], dtype=float)
    assert chisquare(observed, joint / joint.sum() * observed.sum()).pvalue > 1e-3
