"""Cross-entropy over a (reduced) vocabulary in chunks of rows, so that the logits of all the blocks of a
step are never held at once: with every anchor of 4 sequences trained that would be ~12k rows x ~10k
tokens (0.5 GB in float32), and its backward would hold as much again.

The lm_head is the target's and frozen, so the only gradient is the one towards the hidden states; it is
computed in the same pass as the loss (softmax - one-hot, times the head) and kept ([rows, H], as small as
the hidden states). Backward only scales it."""

from __future__ import annotations

import torch

CHUNK = 1024  # rows per chunk: ~40 MB of logits at a 10k vocabulary
GPU_CHUNK = 16384  # a GPU holds 0.6 GB of logits easily, and a 1024-row chunk is a launch-bound loop there


def default_chunk(device) -> int:
    return CHUNK if torch.device(device).type == "cpu" else GPU_CHUNK


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, labels, weights, chunk):
        total = hidden.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(hidden)
        for first in range(0, hidden.shape[0], chunk):
            sl = slice(first, first + chunk)
            logits = (hidden[sl] @ head.t()).float()
            lse = logits.logsumexp(-1)
            lab, w = labels[sl], weights[sl]
            valid = lab >= 0
            w = torch.where(valid, w, 0.0)
            picked = logits.gather(1, lab.clamp_min(0)[:, None])[:, 0]
            total += (w * (lse - picked)).sum()
            # in place: a fresh [chunk, V] tensor per op cost ~10 ms each in page faults on the CPU
            probs = logits.sub_(lse[:, None]).exp_()
            probs[torch.arange(probs.shape[0], device=probs.device), lab.clamp_min(0)] -= valid.to(probs.dtype)
            grad[sl] = (probs.mul_(w[:, None]).to(head.dtype) @ head).to(hidden.dtype)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                          chunk: int = CHUNK) -> torch.Tensor:
    """sum_r weights[r] * CE(hidden[r] @ head^T, labels[r]) over rows whose label is >= 0 (-100: ignored).
    hidden [R, H] (differentiable), head [V, H] (frozen: no gradient), labels [R] (column in head), weights [R]."""
    if head.requires_grad:
        raise ValueError("chunked_cross_entropy: the head must be frozen (it gets no gradient here)")
    return _ChunkedCE.apply(hidden, head.detach(), labels, weights.to(torch.float32), chunk)
