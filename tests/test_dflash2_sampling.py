"""Temperature > 0 with a DFlash2 draft: its proposal q lives on each position's top-k candidates and
depends on the token drafted before it. Emitted tokens must still follow the target's distribution
exactly (chi-square against the enumerated joint, as in test_sampling.py), and a q that is not the
one the tokens were drawn from must be caught."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
from hetero_sd.decoding.sampling import Sampler, SamplingParams
from hetero_sd.backends.selection import SelectorBlock

from . import reference_dflash as ref
from .conftest import make_tiny_target
from .test_sampling import P_MIN, VOCAB, chi_square_p, exact_joint, sample_many


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_tiny_target(tmp_path_factory.mktemp("t8"), "llama", vocab_size=VOCAB, seed=3,
                              initializer_range=0.35)
    draft = tmp_path_factory.mktemp("d8-dflash2")
    ref.make_reference_draft(draft, dflash2=True, vocab=VOCAB)  # top-5 of 8: q is 0 on 3 tokens per position
    return target, draft


CASES = [("rejection", SamplingParams(1.0)), ("rejection", SamplingParams(0.7, top_k=4)),
         ("match", SamplingParams(1.3, top_p=0.8))]


@pytest.mark.parametrize("rule,params", CASES, ids=[f"{r}-T{p.temperature}-k{p.top_k}-p{p.top_p}" for r, p in CASES])
def test_dflash2_samples_follow_the_target_distribution(pair, rule, params):
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    assert rt.info["draft_format"].startswith("dflash2")
    samples, totals = sample_many(rt, params, rule=rule)
    p = chi_square_p(samples, exact_joint(pair[0], params))
    assert p > P_MIN, f"samples do not follow the target distribution (chi-square p = {p:.2e})"
    assert 0 < totals["accepted"] < totals["drafted"]  # both branches of the rule were exercised


def test_negative_control_catches_a_q_the_tokens_were_not_drawn_from(pair, monkeypatch):
    """Tokens from the selector's walk, but q from the draft's logits alone (ignoring the selector)."""
    def unary_q(self, sampler, rule):
        tokens, _ = original(self, sampler, rule)
        return tokens, sampler.probs(self.logits)

    original = SelectorBlock.choose
    monkeypatch.setattr(SelectorBlock, "choose", unary_q)
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    params = SamplingParams(1.0)
    samples, _ = sample_many(rt, params, rule="rejection")
    assert chi_square_p(samples, exact_joint(pair[0], params)) < P_MIN


def test_q_is_a_distribution_on_the_candidates(pair):
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    rt.draft.add_context(torch.randn(7, rt.draft.fc.shape[0]))
    block = rt.draft.propose(anchor=5)
    tokens, q = block.choose(Sampler(SamplingParams(0.9), seed=1), "rejection")
    candidates = torch.topk(block.logits, 5, dim=-1).indices
    assert torch.allclose(q.sum(-1), torch.ones(len(tokens)))
    off = torch.ones_like(q, dtype=torch.bool).scatter(-1, candidates, False)
    assert (q[off] == 0).all() and (q[torch.arange(len(tokens)), torch.tensor(tokens)] > 0).all()
    greedy, none = block.choose(Sampler(SamplingParams(0.0)), "rejection")
    assert none is None and greedy == block.walk(0.0, None)[0]
