"""A captured step is its CUDA graph: a replay runs what was captured, on the tensors the capture saw (inputs are
written into them in place), and its outputs live in the graph's memory pool: every replay writes them again, and
the graphs of one model share one pool, so a replay of any of its steps may overwrite what another returned.
Callers copy what they keep past the model's next step (steps.Runner). On the CPU the fixed steps run afresh each
time, which would hide a caller that keeps an output too long or hands a step new tensors. Here Runner.run replays
as a graph does: each shape runs the function of its first run (its closure's tensors), hands out the same output
tensors each time, and scribbles over every output of the runner's other shapes; a reset (a grown cache) drops
them all, as it drops the graphs. Such a caller changes what is decoded: the tokens, the accepted counts, or the
draft's own proposals (a draft fed stale context features still only proposes: the target's tokens would hide
it). Everything must stay as the fixed steps decode without it."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
from hetero_sd.backends.base import WrappedDraft
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.backends.torch_backend import steps
from hetero_sd.runtime import Runtime

SHORT = [[5, 9, 12, 7], [33, 2, 40, 41, 8, 19, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 34, 35], [60, 61]]
LONG = [(7 * i) % 60 + 4 for i in range(2 * steps.PREFILL[-1] + 37)]  # three prefill chunks
MAX_NEW = 40
FIXED = LoadPolicy(fused=False, quant=False, steps="fixed")
SCRIBBLE = {True: float("nan"), False: -7}  # NaN where floating point, elsewhere an id no vocabulary has


def replayed(self, key, fn):
    captured = self.__dict__.setdefault("captured", {})
    fresh = captured.setdefault(key, fn)()
    pool = self.__dict__.setdefault("replayed", {})
    self.last = key
    for other, outs in pool.items():
        if other != key:
            for t in outs:
                if t is not None:
                    t.fill_(SCRIBBLE[t.is_floating_point()])
    if key not in pool:
        pool[key] = tuple(None if t is None else t.clone() for t in fresh)
    for out, t in zip(pool[key], fresh):
        if out is not None:
            out.copy_(t)
    return pool[key]


def reset(self):
    self.__dict__.pop("captured", None)
    self.__dict__.pop("replayed", None)
    real_reset(self)


real_reset = steps.Runner.reset


def as_graphs(monkeypatch):
    monkeypatch.setattr(steps.Runner, "run", replayed)
    monkeypatch.setattr(steps.Runner, "reset", reset)


class Recorded(WrappedDraft):
    """The draft as it is, each block's proposals (its argmax) kept."""

    def __init__(self, inner):
        super().__init__(inner)
        self.blocks = []

    def propose(self, anchor, position=None, size=None):
        logits = self.inner.propose(anchor, position, size)
        self.blocks.append(logits.argmax(-1).tolist())
        return logits


class Truthful(WrappedDraft):
    """Proposes the target's own continuation, so that blocks are accepted whole (the accepted positions' features
    and ids reach the next block); the draft's block runs as ever, and its NaNs pass into the proposals."""

    def __init__(self, inner, sequence: list[int], vocab: int):
        super().__init__(inner)
        self.sequence, self.vocab = sequence, vocab

    def propose(self, anchor, position=None, size=None):
        logits = self.inner.propose(anchor, position, size)
        at = self.inner.context_length if position is None else position
        truth = (self.sequence[at + 1:at + logits.shape[0] + 1] + [0] * logits.shape[0])[:logits.shape[0]]
        return torch.nn.functional.one_hot(torch.tensor(truth), self.vocab) * 20.0 + 0 * logits


def decode(tiny_llama, tiny_draft, prompts, acceptance="device", schedule="sequential", truthful=False,
           whole=False, block="fixed", lookup=0.0, **kw):
    """(tokens, accepted counts, fallback) of each prompt, and the draft's proposals. whole: the caches allocated
    for the longest prompt first (as CUDA allocates them whole), so that no step of a prompt meets a grown cache."""
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), dtype=torch.float32, policy=FIXED, block_size="fixed",
                        lookup=0, acceptance=acceptance)
    if whole:
        rt.warm(max(map(len, prompts)) + MAX_NEW)
    draft, outs = Recorded(rt.draft), []
    for p in prompts:
        proposer = draft
        if truthful:
            truth = p + rt.generate(p, max_new_tokens=MAX_NEW + 8, stop_at_eos=False, speculative=False).token_ids
            proposer = Truthful(draft, truth, rt.target.config.vocab_size)
        spec = Runtime(rt.target, proposer, rt.tokenizer, rt.stop_ids, rt.info, schedule, block, lookup=lookup,
                       acceptance=acceptance)
        outs.append(spec.generate(p, max_new_tokens=MAX_NEW, stop_at_eos=False, **kw))
    decode.plain_steps = sum(o.stats.plain_steps for o in outs)
    return [(o.token_ids, o.stats.accepted_per_step, o.stats.fallback) for o in outs], draft.blocks


CASES = {"device": {}, "host": dict(acceptance="host"), "overlap": dict(acceptance="host", schedule="overlap"),
         "sampled": dict(temperature=0.8, top_p=0.95, seed=7),
         "rejection": dict(temperature=1.0, seed=3, rule="rejection"), "whole blocks": dict(truthful=True),
         # the controller's plain steps between blocks (their features kept for the draft), the context lookup's
         # blocks, a penalty (accepted on the host)
         "controller": dict(block="auto", lookup=0.4), "penalty": dict(block="auto", lookup=0.4, repetition_penalty=1.3)}
TIMED = ("overlap", "controller", "penalty")  # their choices follow the timing: their tokens do not


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_as_a_replay_hands_them_out_decode_the_same(tiny_llama, tiny_draft, monkeypatch, case):
    want = decode(tiny_llama, tiny_draft, SHORT + [LONG], **CASES[case])
    assert {fallback for *_, fallback in want[0]} == {None} and all(accepted for _, accepted, _ in want[0])
    if case == "whole blocks":
        assert all(set(accepted[:-1]) == {max(accepted)} for _, accepted, _ in want[0])
    as_graphs(monkeypatch)
    got = decode(tiny_llama, tiny_draft, SHORT + [LONG], **CASES[case])
    if case in ("controller", "penalty"):
        assert decode.plain_steps > 0  # (the case covers plain steps)
    if case in TIMED:  # pre-drafted blocks, block sizes and plain steps follow the timing
        got, want = ([(tokens, fallback) for tokens, _, fallback in outs] for outs, _ in (got, want))
    assert got == want


def test_requests_at_once_decode_the_same(tiny_llama, tiny_draft, monkeypatch):
    """Forked pairs: each its own steps, runners and outputs."""
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), dtype=torch.float32, policy=FIXED, block_size="fixed",
                        lookup=0, acceptance="device")
    want = [rt.generate(p, max_new_tokens=MAX_NEW, stop_at_eos=False, speculative=False).token_ids for p in SHORT]
    as_graphs(monkeypatch)
    outs = rt.generate_many(SHORT, schedule="pipeline", max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert [o.token_ids for o in outs] == want and all(o.stats.device_steps for o in outs)


def test_a_caller_keeping_an_output_would_show(tiny_llama, tiny_draft, monkeypatch):
    """The check can fail: a target handing out its prompt chunks' context features uncopied (each chunk's step
    is the same shape, so the last one's features stand for all) feeds the draft stale context."""
    want = decode(tiny_llama, tiny_draft, [LONG], whole=True)
    real = steps.TargetSteps.__call__

    def uncopied(self, token_ids, start, tail=None, last_only=False):
        logits, features, top = real(self, token_ids, start, tail, last_only)
        return logits, None if features is None else self.runner.replayed[self.runner.last][1][:len(features)], top
    as_graphs(monkeypatch)
    monkeypatch.setattr(steps.TargetSteps, "__call__", uncopied)
    got = decode(tiny_llama, tiny_draft, [LONG], whole=True)
    assert got[0][0][0] == want[0][0][0]  # the target's tokens: lossless whatever the draft is fed
    assert got[0][0][2] is not None or got[1] != want[1]  # a draft that failed, or other proposals
