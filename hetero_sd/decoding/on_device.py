"""A block's proposals and verdict computed where the logits are, read by the host once a step (loop.py,
verify_on_device). The same tokens as draft_tokens and verify (sampling.py) compute on the host, by the same
operations on the same values with the same keyed uniforms, so a seeded generation is token for token the one
host acceptance gives: at temperature 0 (argmax), and when sampling under both rules. Only what needs the host
between the draft and the verify stays out (penalties, a grammar, the context lookup, the verify gate, a DFlash2
selector: Runtime.accepted_where)."""

from __future__ import annotations

import torch

from .sampling import Sampler, Verdict, uploaded


def proposals(sampler: Sampler, draft_logits: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """draft_tokens without a read: the draft's argmax (temperature 0, or the match rule), or draws from its
    distribution q (the rejection rule, which also needs q); on the draft's device, row i at position + i."""
    if sampler.params.greedy or rule == "match":
        return draft_logits.argmax(-1), None
    q = sampler.probs(draft_logits)
    return sampler.draw(q, 0, "draft"), q


def verdict(sampler: Sampler, target_logits: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor | None,
            finite: torch.Tensor, rule: str) -> tuple[Verdict | None, list[int]]:
    """verify's verdict on the drafted ids [n] from one read of the device: (the verdict, the drafted ids), or
    (None, the ids) where the draft's logits were not finite (`finite`, read with the rest): a block drawn from
    them is no proposal to accept from."""
    device = target_logits.device
    drafted, finite = uploaded(drafted, device), uploaded(finite, device)
    if not sampler.params.greedy and rule == "rejection":
        return rejected(sampler, target_logits, drafted, uploaded(q, device), finite)
    # the target's token at each row: its argmax, or (match rule) its draw with the uniform of position + i
    posterior = target_logits.argmax(-1) if sampler.params.greedy else sampler.draw(sampler.probs(target_logits), 0)
    n = drafted.shape[0]
    accepted = (drafted == posterior[:n]).cumprod(0).sum()
    read = torch.cat([accepted.view(1), finite.long().view(1), posterior, drafted]).tolist()
    a, tokens = read[0], read[3 + n:]
    return (Verdict(a, tokens[:a] + [read[2 + a]]) if read[1] else None), tokens


def rejected(sampler: Sampler, target_logits: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor,
             finite: torch.Tensor) -> tuple[Verdict | None, list[int]]:
    """sampling.rejection with every candidate outcome computed on the device: each row's ratio p(d)/q(d), each
    row's correction drawn from its residual, and the bonus after a block accepted whole. The host compares the
    ratios with the keyed uniforms (float64, as there) and picks. Each residual is normalised on its own, as the host
    does it (a row's sum taken alone, not as one row of a batched reduction, whose order may differ)."""
    n = drafted.shape[0]
    p = sampler.probs(target_logits)
    rows = torch.arange(n, device=p.device)
    ratio = p[rows, drafted] / q[rows, drafted]
    residuals = []
    for i in range(n):
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        residuals.append(torch.where(total > 0, residual / total, p[i]))  # total 0 only where p == q, as there
    corrections = sampler.draw(torch.stack(residuals), 0, "residual")  # (a drafted block has a draft at least)
    bonus = sampler.draw(p[n:n + 1], n)
    read = torch.cat([finite.double().view(1), ratio.double(), drafted.double(), corrections.double(),
                      bonus.double()]).tolist()
    ok, ratio, tokens, corrections = read[0], read[1:1 + n], [int(t) for t in read[1 + n:1 + 2 * n]], read[1 + 2 * n:]
    if not ok:
        return None, tokens
    for i, r in enumerate(ratio):
        if sampler.uniform(p.device, i) >= r:
            return Verdict(i, tokens[:i] + [int(corrections[i])]), tokens
    return Verdict(n, tokens + [int(corrections[-1])]), tokens
