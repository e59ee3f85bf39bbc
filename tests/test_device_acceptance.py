"""Acceptance on the device (decoding/loop.verify_on_device): the drafted ids go from the draft's argmax into the
target's inputs without the host reading them, greedy acceptance runs on the device and the host reads one small
tensor a step. Run here on the CPU (acceptance="device"), it must decode exactly as host acceptance does: at
temperature 0 the target's own tokens, and when sampling (both rules) the same seeded tokens, with the same accepted
count at every step, on every kind of target step; the context lookup steers there too; it must read the device
once a block; and a draft's non-finite logits, found in that read, must lose no token."""

from __future__ import annotations

import math

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.decoding import on_device
from hetero_sd.decoding import sampling as sampling_module
from hetero_sd.decoding.sampling import Sampler, SamplingParams, draft_tokens, verify
from hetero_sd.errors import InvalidArgumentError
from hetero_sd.runtime import Runtime

from .doubles import FaultyDraft, OracleDraft

PROMPTS = [[5, 9, 12, 7], [33, 2, 40, 41, 8, 19, 22, 23], [60, 61]]
MAX_NEW = 40
# the CPU's default (fused C++ ops), torch ops op by op, and the fixed-shape steps CUDA captures
POLICIES = {"default": LoadPolicy(), "eager": LoadPolicy(fused=False, quant=False, steps="eager"),
            "fixed": LoadPolicy(fused=False, quant=False, steps="fixed")}


def load(tiny_llama, tiny_draft, policy: str, acceptance: str):
    return hetero_sd.load(str(tiny_llama), str(tiny_draft), dtype=torch.float32, policy=POLICIES[policy], lookup=0,
                          block_size="fixed", acceptance=acceptance)


def run(rt: Runtime, prompt, **kw):
    return rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False, **kw)


def with_draft(rt: Runtime, draft, acceptance: str) -> Runtime:
    return Runtime(rt.target, draft, rt.tokenizer, rt.stop_ids, rt.info, "sequential", "fixed", lookup=0,
                   acceptance=acceptance)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_device_acceptance_decodes_as_the_host_does(tiny_llama, tiny_draft, policy):
    host, device = (load(tiny_llama, tiny_draft, policy, a) for a in ("host", "device"))
    for prompt in PROMPTS:
        alone = run(host, prompt, speculative=False).token_ids
        on_host, on_device = run(host, prompt), run(device, prompt)
        assert on_host.stats.acceptance == "host" and on_device.stats.acceptance == "device"
        assert on_device.token_ids == alone == on_host.token_ids
        assert on_device.stats.accepted_per_step == on_host.stats.accepted_per_step
        assert on_device.stats.device_steps == on_device.stats.num_drafts > 0 and on_host.stats.device_steps == 0


@pytest.mark.parametrize("correct", [0, 2, None])  # None: every draft right (the block's full acceptance)
def test_device_acceptance_with_an_oracle_draft(tiny_llama, tiny_draft, correct):
    """A draft right for `correct` positions a block: the accepted counts are exactly that, as on the host."""
    rt = load(tiny_llama, tiny_draft, "fixed", "device")
    prompt = PROMPTS[1]
    truth = prompt + run(rt, prompt, speculative=False).token_ids
    oracle = OracleDraft(truth, rt.draft.block_size, rt.target.config.vocab_size, correct)
    out = {a: run(with_draft(rt, oracle, a), prompt) for a in ("host", "device")}
    assert out["device"].token_ids == out["host"].token_ids == truth[len(prompt):]
    assert out["device"].stats.accepted_per_step == out["host"].stats.accepted_per_step
    full = rt.draft.block_size - 1 if correct is None else correct
    assert set(out["device"].stats.accepted_per_step[:-1]) == {full}


READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("sampled", [{}, dict(temperature=0.8, seed=3, rule="match"),
                                     dict(temperature=1.0, top_p=0.9, seed=3, rule="rejection")])
def test_one_read_of_the_device_a_block(tiny_llama, tiny_draft, monkeypatch, sampled):
    """Every way a tensor's value reaches the host, counted over a generation: one read at the prefill, one per
    block (host acceptance reads the draft's block and then the verdict, and checks the draft's logits apart);
    sampling too, under both rules (the rejection rule's first rejected row is found on the device)."""
    rt = load(tiny_llama, tiny_draft, "fixed", "device")
    run(rt, PROMPTS[0], **sampled)  # built and warmed outside the count
    counts = {}
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, real=real, name=name, **kw):
            counts[name] = counts.get(name, 0) + 1
            return real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    out = run(rt, PROMPTS[0], **sampled)
    monkeypatch.undo()
    assert out.stats.plain_steps == 0 and out.stats.num_drafts > 2
    assert sum(counts.values()) == 1 + out.stats.num_drafts, counts


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8), SamplingParams(1.0, top_k=12, top_p=0.9)])
@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_verdicts_are_the_hosts(params, rule):
    """on_device.proposals and .verdict against sampling.draft_tokens and .verify on the same logits and seeds:
    blocks of 1-5 drafts whose draft is the target itself (q = p: every draft accepted, the bonus drawn), close to
    it, or far from it."""
    outcomes = set()
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        n, vocab = 1 + seed % 5, 40
        target = torch.randn(n + 1, vocab, generator=g) * 2
        draft = target[:n] + torch.randn(n, vocab, generator=g) * (seed % 3)
        drafted, q, _ = on_device.proposals(Sampler(params, seed).at(9), draft, rule)
        want_drafted, want_q = draft_tokens(Sampler(params, seed).at(9), draft, rule)
        assert drafted.tolist() == want_drafted
        checks = torch.tensor([1, 7])  # (finite, and any count read along)
        got = on_device.verdict(Sampler(params, seed).at(9), target, drafted, q, checks, rule)
        want = verify(Sampler(params, seed).at(9), target, want_drafted, want_q, rule)
        assert got == (want, want_drafted, [1, 7])
        outcomes.add("whole" if want.accepted == n else "cut")
    assert outcomes == {"whole", "cut"}
    nan = on_device.verdict(Sampler(params, 1).at(9), target, drafted, q, torch.tensor([math.nan, 0.0]), rule)
    assert nan == (None, want_drafted, [0, 0])
    for bad in (math.nan, math.inf, -math.inf):  # one non-finite logit anywhere in the block
        logits = torch.randn(3, 40)
        logits[1, 7] = bad
        assert on_device.checked(on_device.checks(logits, None).tolist()) == [0, 0]
    assert on_device.checked(on_device.checks(torch.full((3, 40), 3e38), torch.tensor(2)).tolist()) == [1, 2]
    ids = torch.tensor([0, 2**24 - 1, 151935, 262143])  # every id of any vocabulary survives the float32 read
    assert [int(x) for x in torch.cat([torch.zeros(1), ids]).tolist()[1:]] == ids.tolist()


class Ops(TorchDispatchMode):
    """Counts the aten ops run under it: each is a kernel launched by the host on an accelerator."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8), SamplingParams(1.0, top_k=12, top_p=0.9)])
@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_a_verdict_launches_as_many_kernels_whatever_the_block(params, rule, monkeypatch):
    """On an accelerator every op of the verdict is a launch from the host: a block of 15 drafts costs the launches
    of a block of 1 (draws in one scan; the rejection rule's first rejected row found on the device, one residual)."""
    monkeypatch.setattr(sampling_module, "inverse_cdf", partial(sampling_module.inverse_cdf, one_scan=True))
    monkeypatch.setattr(on_device, "inverse_cdf", partial(sampling_module.inverse_cdf, one_scan=True))
    counts = []
    for n in (1, 15):
        g = torch.Generator().manual_seed(n)
        target, draft = torch.randn(n + 1, 50, generator=g), torch.randn(n, 50, generator=g)
        drafted, q, _ = on_device.proposals(Sampler(params, 1).at(4), draft, rule)
        with Ops() as ops:
            on_device.verdict(Sampler(params, 1).at(4), target, drafted, q, torch.tensor([1, 0]), rule)
        counts.append(ops.count)
    assert counts[0] == counts[1], counts


SAMPLING = [dict(temperature=0.8, seed=11), dict(temperature=1.0, top_k=20, top_p=0.9, seed=5),
            dict(temperature=0.7, min_p=0.05, seed=2)]


@pytest.mark.parametrize("rule", ["match", "rejection"])
@pytest.mark.parametrize("params", range(len(SAMPLING)))
def test_sampled_blocks_accepted_on_the_device_as_on_the_host(tiny_llama, tiny_draft, rule, params):
    """Seeded sampling: the device's draws (the draft's under the rejection rule, the target's, each residual's and
    the bonus) use the host's keyed uniforms on the same values, so the seeded tokens and accepted counts are the
    host's exactly; the host's are tested against the target's distribution (test_sampling.py)."""
    kw = SAMPLING[params] | {"rule": rule}
    host, device = (load(tiny_llama, tiny_draft, "fixed", a) for a in ("host", "device"))
    for prompt in PROMPTS:
        on_host, on_device = run(host, prompt, **kw), run(device, prompt, **kw)
        assert on_device.stats.acceptance == "device" and on_device.stats.device_steps == on_device.stats.num_drafts
        assert on_device.token_ids == on_host.token_ids
        assert on_device.stats.accepted_per_step == on_host.stats.accepted_per_step
    assert sum(run(device, p, **kw).stats.num_accepted_tokens for p in PROMPTS) > 0 or rule == "match"


def test_the_next_block_is_launched_before_a_step_is_handed_on(tiny_llama, tiny_draft):
    """On the device path a verified step's successor is drafted before the step is yielded, so the device drafts
    while the caller handles the step; on the host path it is drafted after. Same tokens either way."""
    from hetero_sd.backends.base import WrappedDraft

    class Watched(WrappedDraft):
        def propose(self, anchor, position=None, size=None):
            seen.append(len(consumed))
            return self.inner.propose(anchor, position, size)

    outs = {}
    for acceptance in ("host", "device"):
        rt = load(tiny_llama, tiny_draft, "fixed", acceptance)
        seen, consumed = [], []
        for event in with_draft(rt, Watched(rt.draft), acceptance).stream(PROMPTS[0], max_new_tokens=MAX_NEW,
                                                                            stop_at_eos=False):
            consumed.append(event.token_ids)
        outs[acceptance] = (seen, [t for ids in consumed for t in ids])
    host_seen, device_seen = outs["host"][0], outs["device"][0]
    assert host_seen == list(range(1, len(host_seen) + 1))  # block j drafted after j events were handed on
    assert device_seen == [1] + list(range(1, len(device_seen)))  # ... and before the j-th, from the second block
    assert outs["host"][1] == outs["device"][1]


@pytest.mark.parametrize("kind", ["nan", "raise"])
@pytest.mark.parametrize("at", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_non_finite_draft_logits_lose_no_token(tiny_llama, tiny_draft, at, temperature, kind):
    """NaN logits from the draft's `at`-th block, found in the step's one read (or an error raised by it, also when
    it was launched ahead of the step before): the step is dropped and the target decodes the rest alone from the
    same anchor; the fault is in the stats. Seeded sampling then gives what the
    target alone gives (positions key the draws, whoever makes them)."""
    rt = load(tiny_llama, tiny_draft, "fixed", "device")
    prompt, kw = PROMPTS[1], dict(temperature=temperature, seed=4, rule="rejection")
    alone = run(rt, prompt, speculative=False, **kw).token_ids
    out = run(with_draft(rt, FaultyDraft(rt.draft, at, kind), "device"), prompt, **kw)
    if temperature == 0:
        assert out.token_ids == alone
    host = run(with_draft(rt, FaultyDraft(rt.draft, at, kind), "host"), prompt, **kw)
    assert out.token_ids == host.token_ids and len(out.token_ids) == MAX_NEW
    assert ("non-finite" if kind == "nan" else "injected") in out.stats.fallback and out.stats.device_steps == at - 1
    assert any("finishing this generation autoregressively" in n for n in out.stats.notes)


def test_where_acceptance_runs(tiny_llama, tiny_draft):
    """'auto' keeps a CPU target's acceptance on the host; asked for the device, a generation that needs the host
    between draft and verify says why."""
    auto = hetero_sd.load(str(tiny_llama), str(tiny_draft), dtype=torch.float32, lookup=0, block_size="fixed")
    assert run(auto, PROMPTS[0]).stats.acceptance == "host"
    rt = load(tiny_llama, tiny_draft, "default", "device")
    assert run(rt, PROMPTS[0], temperature=0.7, seed=1).stats.acceptance == "device"
    assert run(rt, PROMPTS[0], lookup=0.4).stats.acceptance == "device"
    assert run(rt, PROMPTS[0], lookup=0.4, temperature=0.5, seed=1, rule="rejection").stats.acceptance == \
        "host (the context lookup under the rejection rule)"
    assert run(rt, PROMPTS[0], schedule="overlap").stats.acceptance.startswith("host (the overlap schedule")
    assert run(rt, PROMPTS[0], repetition_penalty=1.2, verify_gate=0.3).stats.acceptance == \
        "host (penalties, the verify gate)"
    with pytest.raises(InvalidArgumentError, match="acceptance must be one of"):
        hetero_sd.load(str(tiny_llama), str(tiny_draft), acceptance="gpu")
    # on MPS (no float64 there) draws stay on the host; its greedy read is float32 (the decision, not run here)
    req = SimpleNamespace(sampler=SimpleNamespace(params=SamplingParams(0.7), constraint=None), gate=None,
                          lookup=None, rule="match")
    rt.target = SimpleNamespace(device="mps")
    assert rt.accepted_where(req, "sequential") == "host (sampling on MPS)"
    req.sampler.params = SamplingParams()
    assert rt.accepted_where(req, "sequential") == "device"


@pytest.mark.parametrize("weight", [0.9, 0.4])
def test_the_lookup_steers_on_the_device(tiny_llama, tiny_draft, weight):
    """The context lookup steers the device's proposals along its own path. At weight 0.9 every guess beats a random
    draft's token, so the proposals never leave that path and are the host's exactly (the same steered rows and
    accepted counts); at 0.4 they may differ after a row the draft kept. The output is the target's either way."""
    host, device = (load(tiny_llama, tiny_draft, "fixed", a) for a in ("host", "device"))
    prompt = PROMPTS[1] * 3  # repeated: the lookup has guesses
    alone = run(host, prompt, speculative=False).token_ids
    on_host, on_device = run(host, prompt, lookup=weight), run(device, prompt, lookup=weight)
    assert on_device.stats.acceptance == "device" and on_device.token_ids == alone == on_host.token_ids
    assert on_device.stats.lookup_drafts > 0
    if weight == 0.9:
        assert on_device.stats.lookup_drafts == on_host.stats.lookup_drafts
        assert on_device.stats.accepted_per_step == on_host.stats.accepted_per_step


def test_overlap_on_one_accelerator_is_announced():
    """Pre-drafting on the device that verifies queues behind the verify: said, with what to do instead."""
    from hetero_sd.runtime import oversubscription

    note = oversubscription("cuda", "cuda:0")
    assert len(note) == 1 and "cannot overlap" in note[0] and "schedule='sequential'" in note[0]
    assert oversubscription("cuda:0", "cpu") == oversubscription("cuda:0", "cuda:1") == []


def test_the_prefix_cache_keeps_what_a_closed_stream_left_with_a_block_launched_ahead(tiny_llama, tiny_draft):
    """A stream closed while its next block was launched ahead (the draft's context already caught up, its block
    never verified): the next generation reuses the caches and decodes what a fresh runtime decodes."""
    rt, fresh = load(tiny_llama, tiny_draft, "fixed", "device"), load(tiny_llama, tiny_draft, "fixed", "host")
    rt.prefix_cache = True
    prompt = PROMPTS[1]
    first = run(rt, prompt).token_ids
    turn = prompt + first[:5]
    stream = rt.stream(turn, max_new_tokens=MAX_NEW, stop_at_eos=False)
    for _ in range(3):
        next(stream)
    stream.close()
    again = run(rt, turn + [7])
    assert again.stats.num_cached_tokens > len(prompt)
    assert again.token_ids == run(fresh, turn + [7]).token_ids


def test_pipelined_requests_accept_on_the_device(tiny_llama, tiny_draft):
    """Two requests at once (each a sequential loop on its own thread and caches), both accepted on the device and
    each launching ahead: the target's tokens for each; stop_at_eos applies to every prompt."""
    rt = load(tiny_llama, tiny_draft, "fixed", "device")
    alone = [run(rt, p, speculative=False).token_ids for p in PROMPTS]
    outs = rt.generate_many(PROMPTS, schedule="pipeline", max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert [o.token_ids for o in outs] == alone
    assert {o.stats.acceptance for o in outs} == {"device"} and all(o.stats.device_steps for o in outs)
