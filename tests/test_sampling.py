"""Temperature > 0: the emitted tokens must be distributed exactly as the target's own samples.

A tiny target with an 8-token vocabulary lets us enumerate the exact joint distribution of the first
three generated tokens (512 outcomes) with transformers, then compare thousands of generations against
it with a chi-square test. A negative control shows the test catches a subtly wrong acceptance rule."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import hetero_sd
import hetero_sd.decoding.sampling as sampling
from hetero_sd.models.config import ArchConfig, read_json
from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft
from hetero_sd.decoding.sampling import Sampler, SamplingParams, Verdict

from .conftest import make_tiny_target

VOCAB, PROMPT, N, STEPS = 8, [2, 5, 6, 4], 2500, 3
REPEATS = [2, 5, 6, 2, 5, 6, 2, 5]  # the context lookup guesses 6 after it (decoding/lookup.py)
P_MIN = 1e-3  # a correct sampler fails this test one time in a thousand


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_tiny_target(tmp_path_factory.mktemp("t8"), "llama", vocab_size=VOCAB, seed=3,
                              initializer_range=0.35)
    cfg = ArchConfig.from_dict(read_json(target / "config.json"))
    raw = draft_config(cfg, num_layers=1, block_size=4, mask_token_id=3, layer_ids=[1, 3])
    draft = write_draft(tmp_path_factory.mktemp("d8"), raw, random_draft_tensors(raw, seed=1, std=0.3),
                        dtype=torch.float32)
    return target, draft


def exact_joint(target_folder, params: SamplingParams, prompt: list[int] = PROMPT) -> dict[tuple, float]:
    """P(first three tokens) by enumeration with transformers' model and our logits processing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32).eval()
    probs = Sampler(params).probs

    def next_probs(prefixes):
        with torch.no_grad():
            return probs(model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]).double()

    joint = {(): 1.0}
    for _ in range(STEPS):
        prefixes = list(joint)
        p = next_probs(prefixes)
        joint = {pre + (t,): joint[pre] * p[i, t].item() for i, pre in enumerate(prefixes) for t in range(VOCAB)}
    return joint


def chi_square_p(samples: list[tuple], joint: dict[tuple, float]) -> float:
    counts = Counter(samples)
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = np.array([joint[c] * len(samples) for c in cells])
    observed = np.array([counts.get(c, 0) for c in cells], dtype=float)
    assert sum(counts.values()) == observed.sum(), "a sample fell outside the enumerated outcomes"
    assert observed[expected == 0].sum() == 0, "a sample has probability zero under the target"
    big = expected >= 5  # pool the rare outcomes into one cell so the chi-square approximation holds
    rare = (expected < 5) & (expected > 0)
    exp, obs = expected[big], observed[big]
    if rare.any():
        exp, obs = np.append(exp, expected[rare].sum()), np.append(obs, observed[rare].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def sample_many(rt, params: SamplingParams, speculative=True, rule="match", prompt=PROMPT, **kw) -> tuple[list[tuple], dict]:
    out, totals = [], Counter()
    for seed in range(N):
        g = rt.generate(prompt, max_new_tokens=STEPS, temperature=params.temperature, top_k=params.top_k,
                        top_p=params.top_p, seed=seed, speculative=speculative, rule=rule, **kw)
        out.append(tuple(g.token_ids))
        totals.update(accepted=g.stats.num_accepted_tokens, drafted=g.stats.num_draft_tokens,
                      gated=g.stats.gated_drafts, steered=g.stats.lookup_drafts, lookup_blocks=g.stats.lookup_blocks)
    return out, totals


CASES = [("autoregressive", SamplingParams(1.0)), ("match", SamplingParams(1.0)),
         ("rejection", SamplingParams(1.0)), ("rejection", SamplingParams(0.7, top_k=4)),
         ("match", SamplingParams(1.3, top_p=0.8))]


@pytest.mark.parametrize("rule,params", CASES, ids=[f"{r}-T{p.temperature}-k{p.top_k}-p{p.top_p}" for r, p in CASES])
def test_samples_follow_the_target_distribution(pair, rule, params):
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    samples, totals = sample_many(rt, params, speculative=rule != "autoregressive",
                                  rule="match" if rule == "autoregressive" else rule)
    p = chi_square_p(samples, exact_joint(pair[0], params))
    assert p > P_MIN, f"samples do not follow the target distribution (chi-square p = {p:.2e})"
    if rule != "autoregressive":  # both branches of the rule were exercised
        assert 0 < totals["accepted"] < totals["drafted"]


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_gated_blocks_follow_the_target_distribution(pair, rule):
    """The verify gate cuts a block at the first draft whose q is below it: which drafts are checked depends
    on the draft alone, so the samples still follow the target (both the gate and acceptance exercised)."""
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    params = SamplingParams(1.0)
    samples, totals = sample_many(rt, params, rule=rule, verify_gate=0.5)
    p = chi_square_p(samples, exact_joint(pair[0], params))
    assert p > P_MIN, f"gated samples do not follow the target distribution (chi-square p = {p:.2e})"
    assert 0 < totals["accepted"] < totals["drafted"] and totals["gated"] > 0


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_proposals_mixed_with_the_context_lookup_follow_the_target_distribution(pair, rule):
    """With the context lookup at a high weight its guesses make most proposals (decoding/lookup.py): under
    `rejection` the tokens are drawn from the mixture and divided by it, under `match` the mixture's top
    token is proposed; either way the samples follow the target."""
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    params = SamplingParams(1.0)
    samples, totals = sample_many(rt, params, rule=rule, prompt=REPEATS, lookup=0.9)
    p = chi_square_p(samples, exact_joint(pair[0], params, REPEATS))
    assert p > P_MIN, f"samples with the lookup do not follow the target distribution (chi-square p = {p:.2e})"
    assert 0 < totals["accepted"] < totals["drafted"] and totals["steered"] > 0


def test_negative_control_catches_a_lookup_that_hides_its_mixture(pair, monkeypatch):
    """Drawing from the mixture but handing the rule the draft's own q (a plausible slip) must fail."""
    from hetero_sd.decoding.lookup import ContextLookup

    mixed = ContextLookup.mix
    monkeypatch.setattr(ContextLookup, "mix", lambda self, q, draw: (mixed(self, q, draw)[0], q))
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    params = SamplingParams(1.0)
    samples, totals = sample_many(rt, params, rule="rejection", prompt=REPEATS, lookup=0.9)
    assert totals["steered"] > 0 and chi_square_p(samples, exact_joint(pair[0], params, REPEATS)) < P_MIN


def test_negative_control_catches_a_wrong_rejection_rule(pair, monkeypatch):
    """Resampling from p (instead of the residual max(p - q, 0)) after a rejection is a classic bug."""
    def biased(sampler, p, drafted, q):
        for i, d in enumerate(drafted):
            if sampler.uniform(p.device) >= (p[i, d] / q[i, d]).item():
                return Verdict(i, drafted[:i] + [sampler.draw(p[i][None])[0].item()])
        return Verdict(len(drafted), drafted + [sampler.draw(p[len(drafted)][None])[0].item()])

    monkeypatch.setattr(sampling, "rejection", biased)
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed")
    params = SamplingParams(1.0)
    samples, _ = sample_many(rt, params, rule="rejection")
    assert chi_square_p(samples, exact_joint(pair[0], params)) < P_MIN


def test_top_k_and_top_p_processing():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = Sampler(SamplingParams(1.0, top_k=2)).probs(logits)[0]
    assert (p[2:] == 0).all() and torch.isclose(p[:2].sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    p = Sampler(SamplingParams(1.0, top_p=0.8)).probs(logits)[0]
    keep = int((p > 0).sum())
    assert full[:keep - 1].sum() < 0.8 <= full[:keep].sum()  # the smallest prefix reaching top_p
    assert Sampler(SamplingParams(1.0, top_p=1e-9)).probs(logits)[0].argmax() == 0


def test_greedy_rows_take_the_first_maximum_as_torch_does():
    """argmax_rows (numpy on CPU float32 rows) is torch.argmax's pick: ties go to the first index, a reduced
    head's FLOOR columns never win, non-contiguous rows and other dtypes (torch's path) agree."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4099, generator=g)
    x[1, 7] = x[1, 4000] = x[1].max() + 1  # a tie: the first wins
    x[2] = -1e30
    x[2, 3001] = 0.5  # a reduced head's row: FLOOR everywhere but its scored ids
    x[3] = 2.0  # all equal
    for rows in (x, x[:, ::2], x.t().contiguous().t(), x.double(), x[:1]):
        assert sampling.argmax_rows(rows) == rows.argmax(-1).tolist()
    assert sampling.argmax_rows(x)[1:4] == [7, 3001, 0]


def test_a_greedy_token_is_read_off_the_steps_argmax_where_nothing_changes_the_logits():
    """Sampler.sample(argmax=): a greedy row takes the argmax its step computed on the device (TargetOutput.argmax)
    unless penalties or a grammar change the logits first; sampling never reads it."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    marked = torch.tensor([3])  # (not the logits' argmax: shows which was read)
    assert Sampler(SamplingParams(), 0).sample(logits, argmax=marked) == [3]
    assert Sampler(SamplingParams(), 0).sample(logits) == [1]
    penalized = Sampler(SamplingParams(repetition_penalty=1.3), 0)
    assert penalized.sample(logits, argmax=marked) == penalized.sample(logits)
    sampled = Sampler(SamplingParams(0.8), 5)
    assert sampled.sample(logits, argmax=marked) == Sampler(SamplingParams(0.8), 5).sample(logits)


def test_draws_in_one_scan_are_the_row_by_row_draws():
    """inverse_cdf on an accelerator scans all rows at once: the same tokens as row by row (the CPU's way), with
    zero-probability tokens (never drawn, even at u = 0 or u near 1) and a one-hot row."""
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(9, 4099, generator=g) ** 4
    probs[:, ::3] = 0  # zero-probability tokens, the first among them
    probs[4] = 0
    probs[4, 17] = 1  # one-hot
    probs /= probs.sum(-1, keepdim=True)
    u = torch.rand(9, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1 - 2 ** -53
    one = sampling.inverse_cdf(probs, u, one_scan=True)
    assert one.tolist() == sampling.inverse_cdf(probs, u, one_scan=False).tolist()
    assert one[4] == 17 and (probs[torch.arange(9), one] > 0).all()


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_lookup_blocks_follow_the_target_distribution(pair, rule, monkeypatch):
    """Blocks of the lookup's guesses alone: a point mass on each guess, under either rule."""
    from .test_lookup import force_lookup_blocks

    force_lookup_blocks(monkeypatch)
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="auto")
    params = SamplingParams(1.0)
    samples, totals = sample_many(rt, params, rule=rule, prompt=REPEATS)
    p = chi_square_p(samples, exact_joint(pair[0], params, REPEATS))
    assert p > P_MIN, f"samples with lookup blocks do not follow the target distribution (chi-square p = {p:.2e})"
    assert totals["lookup_blocks"] > 0


def test_proposals_with_a_corpus_table_follow_the_target_distribution(pair, tmp_path):
    """The corpus table's guesses join the mixture (decoding/lookup.py): samples still follow the target."""
    import shutil

    from hetero_sd.decoding.lookup import CORPUS_FILE, CorpusTable

    draft = tmp_path / "draft"
    shutil.copytree(pair[1], draft)
    g = torch.Generator().manual_seed(5)
    CorpusTable.build([([], torch.randint(0, VOCAB, (400,), generator=g).tolist())]).save(draft / CORPUS_FILE)
    rt = hetero_sd.load(str(pair[0]), str(draft), block_size="fixed")
    assert rt.corpus is not None
    params = SamplingParams(1.0)
    samples, totals = sample_many(rt, params, rule="rejection", lookup=0.4)
    p = chi_square_p(samples, exact_joint(pair[0], params))
    assert p > P_MIN, f"samples with the corpus table do not follow the target distribution (chi-square p = {p:.2e})"
    assert totals["steered"] > 0
