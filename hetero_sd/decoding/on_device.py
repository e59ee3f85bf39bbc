"""A block's proposals and verdict computed where the logits are, read by the host once a step (loop.py,
verify_on_device). The same tokens as draft_tokens and verify (sampling.py) compute on the host, by the same
operations on the same values with the same keyed uniforms, so a seeded generation is token for token the one
host acceptance gives: at temperature 0 (argmax), and when sampling under both rules. (On an accelerator a block's
rows are drawn in one scan, sampling.inverse_cdf: float64 sums that may differ from one row's own in the last bit,
which moves a draw only where its uniform falls within that rounding of a token's boundary.) Its kernels are as
many whatever the block's length: each is a launch by the host there. The context lookup steers
greedy and `match` proposals here too, along its own path (`steered`: where the draft leaves that path, the
proposals after it may differ from the host's; the verdict on them is the same rule's). Only what needs the host
between the draft and the verify stays out (penalties, a grammar, the lookup under the rejection rule, the verify
gate, a DFlash2 selector: Runtime.accepted_where)."""

from __future__ import annotations

import math

import torch

from hetero_sd.backends.base import uploaded

from .lookup import ContextLookup
from .sampling import Sampler, Verdict, inverse_cdf


def proposals(sampler: Sampler, draft_logits: torch.Tensor, rule: str,
              lookup: ContextLookup | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """draft_tokens without a read: the draft's argmax (temperature 0, or the match rule), steered by the context
    lookup's guesses (`steered`), or draws from its distribution q (the rejection rule, which also needs q); on
    the draft's device, row i at position + i. Returns (the ids, q or None, how many rows the lookup changed, or
    None where it did not steer)."""
    if sampler.params.greedy or rule == "match":
        top = draft_logits.argmax(-1)
        return steered(draft_logits, top, *lookup.path(top.shape[0])) if lookup is not None else (top, None, None)
    q = sampler.probs(draft_logits)
    return sampler.draw(q, 0, "draft"), q, None


def checks(draft_logits: torch.Tensor, changed: torch.Tensor | None) -> torch.Tensor:
    """What the verdict's read carries of the draft: float32 [the sum of (logit - logit), 0 exactly where every
    logit is finite and NaN where one is not (no sum of finite values can overflow to look non-finite), and, where
    the lookup steered, how many rows it changed]. Two or three kernels (torch.isfinite alone is four); float32,
    as MPS has no float64."""
    total = (draft_logits - draft_logits).sum(dtype=torch.float32).view(1)
    return total if changed is None else torch.cat([total, changed.view(1)])


def checked(read: list[float]) -> list[int]:
    """[1 where the draft's logits were finite (else 0), rows the lookup changed] from the read of `checks`."""
    return [int(math.isfinite(read[0])), int(read[1]) if len(read) > 1 else 0]


def steered(logits: torch.Tensor, top: torch.Tensor, path: list[int], guesses: list[dict[int, float]]):
    """lookup.steer where the draft's tokens stay on the device. Row i takes the likeliest token of
    q' = (1 - w) q + w [guess] among the draft's own and the guesses (a tie keeps the draft's), as there, while the
    rows before it took the lookup's own path (ContextLookup.path), whose guesses the host has looked up; past a row
    that left the path, the draft's own tokens (the host would look guesses up after them, which it cannot do here
    unread): another proposal, verified as any other. Returns (the ids, None, how many rows the lookup changed)."""
    device, m = logits.device, len(path)
    if m == 0:
        return top, None, None
    width = max(len(g) for g in guesses)  # padding: the row's path token again, weight 0
    ids = uploaded(torch.tensor([list(g) + [p] * (width - len(g)) for g, p in zip(guesses, path)]), device)
    w = uploaded(torch.tensor([list(g.values()) + [0.0] * (width - len(g)) for g in guesses]), device)
    own = top[:m]
    q = torch.softmax(logits[:m].float(), -1)  # (one fused pass: an exp and a sum apart took ~10x on a CPU)
    candidates = torch.cat([own[:, None], ids], 1)  # column 0: the draft's own, which argmax keeps on a tie
    extra = ((candidates[:, :, None] == ids[:, None, :]) * w[:, None, :]).sum(-1)
    score = (1 - w.sum(-1, keepdim=True)) * q.gather(1, candidates) + extra
    best = candidates.gather(1, score.argmax(-1, keepdim=True))[:, 0]
    on_path = torch.cat([torch.ones(1, dtype=torch.long, device=device),
                         (best == uploaded(torch.tensor(path), device))[:-1].long().cumprod(0)])
    chosen = torch.where(on_path.bool(), best, own)
    return torch.cat([chosen, top[m:]]), None, (chosen != own).sum()


def verdict(sampler: Sampler, target_logits: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor | None,
            draft_checks: torch.Tensor, rule: str,
            target_argmax: torch.Tensor | None = None) -> tuple[Verdict | None, list[int], list[int]]:
    """verify's verdict on the drafted ids [n] from one read of the device: (the verdict, the drafted ids, `checked`
    of the `checks` read with them). The verdict is None where the draft's logits were not finite: a block drawn
    from them is no proposal to accept from. The read is float32, as the checks are: it holds every token id
    exactly (ids below 2^24: any vocabulary). Under the match rule and at temperature 0 the accepted count is the
    host's, from the ids read (a few comparisons in Python, where on the device they would be as many launches).
    `target_argmax`: the target's argmax per row where its step computed it (TargetOutput.argmax), read at once."""
    device = target_logits.device
    drafted, draft_checks = uploaded(drafted, device), uploaded(draft_checks, device).float()
    if not sampler.params.greedy and rule == "rejection":
        return rejected(sampler, target_logits, drafted, uploaded(q, device), draft_checks)
    # the target's token at each row: its argmax, or (match rule) its draw with the uniform of position + i
    posterior = (target_logits.argmax(-1) if target_argmax is None else target_argmax) if sampler.params.greedy \
        else sampler.draw(sampler.probs(target_logits), 0)
    n, c = drafted.shape[0], draft_checks.shape[0]
    read = torch.cat([draft_checks, posterior, drafted]).tolist()
    ok, target, tokens = checked(read[:c]), [int(t) for t in read[c:c + n + 1]], [int(t) for t in read[c + n + 1:]]
    a = next((i for i, (d, t) in enumerate(zip(tokens, target)) if d != t), n)
    return (Verdict(a, tokens[:a] + [target[a]]) if ok[0] else None), tokens, ok


def rejected(sampler: Sampler, target_logits: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor,
             draft_checks: torch.Tensor) -> tuple[Verdict | None, list[int], list[int]]:
    """sampling.rejection on the device, in as many kernels whatever the block's length: each row's ratio p(d)/q(d)
    against the host's keyed uniforms for accepting (float64, as there), the first rejected row `a` (n when none is),
    and one draw: from row a's residual norm(max(p - q, 0)) with the residual's uniform of position + a, or from p's
    row n with the sampling uniform of position + n (the bonus). The residual is row a's alone, normalised by its
    own sum, as the host computes it; the draw is `draw`'s on one row."""
    n, device = drafted.shape[0], target_logits.device  # n >= 1: the verify gate, which may keep none, is the host's
    p = sampler.probs(target_logits)
    rows = torch.arange(n, device=device)
    ratio = p[rows, drafted] / q[rows, drafted]
    keyed = uploaded(torch.tensor(sampler.uniforms(n, 0, "accept") + sampler.uniforms(n, 0, "residual")
                                  + sampler.uniforms(1, n, "sample"), dtype=torch.float64), device)
    a = (keyed[:n] < ratio.double()).long().cumprod(0).sum().view(1)  # accepted: the rows before the first rejection
    row = p.index_select(0, a)[0]  # p at the first rejection, or the bonus's row n
    residual = (row - q.index_select(0, a.clamp_max(n - 1))[0]).clamp_min(0)
    total = residual.sum()
    # total 0 only where p == q, where a rejection has probability zero (rounding): p's row, as there
    row = torch.where((a < n) & (total > 0), residual / total, row)
    token = inverse_cdf(row[None], keyed[n:].index_select(0, a))
    c = draft_checks.shape[0]
    read = torch.cat([draft_checks, a, drafted, token]).tolist()  # (float32, as the checks are)
    ok, accepted, tokens = checked(read[:c]), int(read[c]), [int(t) for t in read[c + 1:c + 1 + n]]
    if not ok[0]:
        return None, tokens, ok
    return Verdict(accepted, tokens[:accepted] + [int(read[-1])]), tokens, ok
