"""Loop-aware metrics: greedy decoding of a small model falls into loops, and a loop is easy to draft,
so it inflates tau and speedup. These figures split every answer into its loop part and the rest.

The rule (one for every system, ours and the peers): a generated token is a *loop token* when the
LOOP_NGRAM tokens ending with it already appeared, in the same order, earlier in the same answer
(the prompt does not count). The first LOOP_NGRAM - 1 tokens of a repeat are therefore not counted:
the rule only marks a token once the repeat is unambiguous. It measures repetition, not intent: a
legitimately repeated 8-token line counts too. Systems that return only text are measured on the
text encoded with the target's tokenizer (every peer here shares that vocabulary).
Why 8: on the shipped draft's earlier HumanEval/chat answers (benchmarks/results/*.json), n=8 gives
0-4% on normal answers and 15-70% on the visibly looping ones; n=4 already flags 4-13% of normal
code (indentation, `return`), and n=16 misses the shorter loops.

Loop-free tau splits each verify step between the two parts in proportion to its tokens (a step of
5 tokens, 3 of them loop-free, gives 3 tokens and 0.6 steps to the loop-free part), so long steps
are not over- or under-weighted. Loop-free speedup attributes speculative time per step and
autoregressive time per token (each costs about the same everywhere), which makes it
speedup x tau_loop_free / tau."""

from __future__ import annotations

from collections.abc import Sequence

LOOP_NGRAM = 8


def loop_mask(ids: Sequence[int], n: int = LOOP_NGRAM) -> list[bool]:
    """mask[i]: token i ends an n-gram that ended at an earlier position of the same answer."""
    seen, mask = set(), []
    for i in range(len(ids)):
        if i + 1 < n:
            mask.append(False)
            continue
        gram = tuple(ids[i + 1 - n:i + 1])
        mask.append(gram in seen)
        seen.add(gram)
    return mask


def step_lengths(accepted_per_step: Sequence[int], num_tokens: int) -> list[int]:
    """Tokens emitted by each verify step (accepted + bonus). The first token comes from prefill and
    belongs to no step; the last step may be cut by the length limit or a stop token."""
    lengths, left = [], num_tokens - 1
    for a in accepted_per_step:
        take = min(a + 1, left)
        if take <= 0:
            break
        lengths.append(take)
        left -= take
    return lengths


def loop_counts(ids: Sequence[int], lengths: Sequence[int] | None = None) -> dict:
    """Additive counts for one answer: tokens, loop tokens; with the step lengths (tokens 1.. of the
    answer, see step_lengths), the loop-free tokens emitted by steps and their share of the steps."""
    mask = loop_mask(ids)
    out = {"tokens": len(ids), "loop_tokens": sum(mask)}
    if lengths is not None:
        free = free_steps = 0.0
        pos = 1  # token 0 is the prefill token
        for n in lengths:
            k = n - sum(mask[pos:pos + n])
            free, free_steps, pos = free + k, free_steps + k / n, pos + n
        out |= {"steps": len(lengths), "step_tokens": sum(lengths), "free_step_tokens": free,
                "free_steps": free_steps}
    return out


def add_counts(counts: Sequence[dict]) -> dict:
    keys = set.intersection(*(set(c) for c in counts)) if counts else set()
    return {k: sum(c[k] for c in counts) for k in keys}


def loop_figures(c: dict, speedup: float | None = None) -> dict:
    """Share, tau on everything and on the loop-free part (when steps are known), and the loop-free
    speedup (when the plain speedup is given)."""
    out = {"loop_share": c["loop_tokens"] / c["tokens"] if c.get("tokens") else 0.0,
           "tau_all": None, "tau_loop_free": None}  # None: no speculative step (the controller decoded plainly)
    if c.get("steps"):
        tau = c["step_tokens"] / c["steps"]
        free = c["free_step_tokens"] / c["free_steps"] if c["free_steps"] else None
        out |= {"tau_all": tau, "tau_loop_free": free}
        if speedup is not None and free is not None:
            out["speedup_loop_free"] = speedup * free / tau
    return out
