"""min_p and the repetition, presence and frequency penalties (decoding/penalties.py): applied to the
target's distribution before acceptance, with each verified block position penalised by the tokens
before it (drafts earlier in the block included), so both acceptance rules stay lossless: greedy
outputs identical to autoregressive decoding, and samples distributed as the penalised target
(chi-square on the exact joint of the first three tokens, as in test_sampling.py), and block rows
checked directly against a sampler that would forget the block's earlier drafts."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
import hetero_sd.decoding.sampling as sampling
from hetero_sd.decoding.penalties import History, min_p_filter, penalize
from hetero_sd.decoding.sampling import Sampler, SamplingParams
from hetero_sd.errors import InvalidArgumentError

from .test_sampling import P_MIN, PROMPT, STEPS, VOCAB, chi_square_p, pair  # noqa: F401 (pair: a fixture)

N = 1200  # generations per test (test_sampling.py takes 2500; these penalties move the distribution far)

PENALIZED = SamplingParams(1.0, min_p=0.02, repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=0.5)
KW = dict(min_p=PENALIZED.min_p, repetition_penalty=PENALIZED.repetition_penalty,
          presence_penalty=PENALIZED.presence_penalty, frequency_penalty=PENALIZED.frequency_penalty)


def exact_joint(target_folder, params: SamplingParams) -> dict[tuple, float]:
    """P(first three tokens), each step's distribution penalised by the prompt and the tokens before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32).eval()
    joint = {(): 1.0}
    for _ in range(STEPS):
        prefixes = list(joint)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        nxt = {}
        for i, pre in enumerate(prefixes):
            s = Sampler(params)
            s.history.prompt, s.history.output = list(PROMPT), list(pre)
            p = s.probs(logits[i:i + 1]).double()[0]
            nxt.update({pre + (t,): joint[pre] * p[t].item() for t in range(VOCAB)})
        joint = nxt
    return joint


def samples(rt, rule: str, speculative: bool = True):
    out, accepted = [], 0
    for seed in range(N):
        g = rt.generate(PROMPT, max_new_tokens=STEPS, temperature=1.0, seed=seed, rule=rule,
                        speculative=speculative, **KW)
        out.append(tuple(g.token_ids))
        accepted += g.stats.num_accepted_tokens
    return out, accepted


@pytest.fixture(scope="module")
def joint(pair):
    return exact_joint(pair[0], PENALIZED)


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_penalized_samples_follow_the_penalized_target(pair, joint, rule):
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), block_size="fixed", cpu_threads=1)  # a tiny model: 1 thread
    got, accepted = samples(rt, rule)
    assert accepted > 0  # blocks with accepted drafts, whose later rows carry the drafts' penalties
    p = chi_square_p(got, joint)
    assert p > P_MIN, f"penalised speculative samples do not follow the target (chi-square p = {p:.2e})"


def test_block_rows_are_penalised_with_the_drafts_before_them():
    """The case the chi-square test sees rarely (a random draft is seldom accepted): every row of a block
    has the same logits, favouring token 4; the drafts are [4, 4]. Row 0 may take 4, but row 1 follows
    an accepted 4 and is penalised for it, so a second 4 is refused. A sampler that penalised every row
    with the emitted tokens only would accept both (both rules, greedy and sampled)."""
    logits = torch.full((3, VOCAB), 0.0)
    logits[:, 4], logits[:, 5] = 3.0, 2.0
    for params, rule in ((SamplingParams(0.0, presence_penalty=2.0), "match"),
                         (SamplingParams(0.05, presence_penalty=2.0), "match"),
                         (SamplingParams(0.05, presence_penalty=2.0), "rejection")):
        s = Sampler(params, seed=0)
        s.emitted([6])
        q = torch.zeros(2, VOCAB)
        q[:, 4] = 1.0
        verdict = sampling.verify(s, logits, [4, 4], q if rule == "rejection" else None, rule)
        assert verdict.accepted == 1 and verdict.tokens == [4, 5], (params, rule, verdict)
        # the same rows without the block's drafts would accept both: the test can fail
        assert Sampler(params, seed=0).sample(logits[:2]) == [4, 4]


def test_greedy_with_penalties_is_lossless(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed", cpu_threads=1)
    prompt = [5, 9, 12, 20, 7, 33]
    kw = dict(max_new_tokens=40, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    base = rt.generate(prompt, speculative=False, **kw)
    assert rt.generate(prompt, **kw).token_ids == base.token_ids
    plain = rt.generate(prompt, speculative=False, max_new_tokens=40)
    assert plain.token_ids != base.token_ids, "the penalties changed nothing: the test would not see them"


def test_penalty_formulas_match_transformers():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 10) * 3
    h = History([1, 2])
    h.output = [2, 5, 5]
    ids = torch.tensor([[1, 2, 2, 5, 5]])
    want = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    assert torch.allclose(penalize(logits, h, None, 1.5, 0.0, 0.0), want)
    got = penalize(logits, h, None, 1.0, 0.5, 0.25)
    manual = logits.clone()
    manual[0, 2] -= 0.5 + 0.25
    manual[0, 5] -= 0.5 + 0.5  # presence once, frequency twice; prompt tokens (1) are not counted
    assert torch.allclose(got, manual)
    # A block's rows: row i also counts drafted[:i].
    rows = penalize(logits.expand(3, 10), h, [7, 7], 1.0, 0.0, 1.0)
    assert rows[0, 7] == logits[0, 7] and rows[1, 7] == logits[0, 7] - 1 and rows[2, 7] == logits[0, 7] - 2
    warped = MinPLogitsWarper(0.2)(ids, logits.clone())
    assert torch.equal(torch.isinf(min_p_filter(logits, 0.2)), torch.isinf(warped))


def test_penalty_arguments_are_checked(tiny_llama):
    rt = hetero_sd.load(str(tiny_llama), None)
    for bad in (dict(min_p=1.5), dict(repetition_penalty=0), dict(presence_penalty=3), dict(frequency_penalty="1")):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            rt.generate([5, 6], max_new_tokens=2, **bad)
