"""The draft's head on torch: the final hidden states times the target's lm_head (the whole head, or only
the rows of the draft's reduced vocabulary: hetero_sd/models/draft_vocab.py), then the format's output
multiplier and softcap, as float32 logits over the target's whole vocabulary.

A reduced head multiplies K rows instead of V (on the CPU: the target's GGUF head blocks at those rows
times int8 rows, as the full draft head does; elsewhere the dense rows in the draft's dtype) and writes
the K scores into a row of draft_vocab.FLOOR, so everything after the draft (acceptance rules, DFlash2's
selector, drift, pre-draft ranking) sees logits over the target's vocabulary with probability 0 outside
the K ids. The multiplier and softcap act on the K scores only: a softcap of FLOOR would give the
unscored tokens a finite -softcap, i.e. a probability."""

from __future__ import annotations

import numpy as np
import torch

from hetero_sd.backends.policy import DEFAULT, LoadPolicy
from hetero_sd.models import draft_vocab

from . import quant8
from .kernels import KernelUnavailable
from .matmul import linear, orient


def output_logits(logits: torch.Tensor, fmt) -> torch.Tensor:
    if fmt.output_multiplier != 1.0:
        logits = logits * fmt.output_multiplier
    if fmt.logit_softcap is not None:
        logits = torch.tanh(logits / fmt.logit_softcap) * fmt.logit_softcap
    return logits


class DraftHead:
    """hidden [n, H] -> float32 logits [n, vocab]. mm: the multiplier of the head's rows (a tensor [H, rows]
    or a plan's multiplier); ids: the target ids of those rows when they are not the whole vocabulary."""

    def __init__(self, mm, fmt, ids: torch.Tensor | None = None, vocab_size: int | None = None):
        self.mm, self.format, self.vocab_size = mm, fmt, vocab_size
        self.ids = None if ids is None else ids.to(torch.int64)
        self.scatter_index: torch.Tensor | None = None

    @property
    def rows(self) -> int | None:
        return None if self.ids is None else self.ids.numel()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.float() if getattr(self.mm, "blocks", False) else hidden  # GGUF blocks take float32 rows
        logits = output_logits(linear(rows, self.mm), self.format).float()
        if self.ids is None:
            return logits
        if self.ids.device != logits.device:
            self.ids = self.ids.to(logits.device)
        return draft_vocab.expand(logits, self.ids, self.vocab_size)


def vocab_ids(tensors: dict, policy: LoadPolicy = DEFAULT) -> torch.Tensor | None:
    """The draft's reduced vocabulary (checked by draft_format.check_tensors), unless the policy says to
    use the full head."""
    ids = tensors.get(draft_vocab.TENSOR)
    return ids if ids is not None and policy.draft_vocab else None


def sliced(lm_head: torch.Tensor, ids: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """lm_head [H, V] (the target's, as it holds it) -> the draft's [H, K] in the layout `linear` prefers."""
    return orient(lm_head.t()[ids.to(lm_head.device)].to(device, dtype))


def reduced_blocks(target, ids: torch.Tensor, lm_head: torch.Tensor, device: str, int8: bool):
    """On the CPU, the target's GGUF head blocks at the K rows times int8 rows (what plan.draft_head does for
    the whole head: the draft only proposes), with a note; else (None, None): the dense rows then."""
    plan = getattr(target, "plan", None)
    head = plan.blocks.get("lm_head") if plan is not None and plan.blocks else None
    if not int8 or device != "cpu" or head is None:
        return None, None
    kind, rows = head
    try:
        mm = quant8.Int8Blocks(kind, np.ascontiguousarray(np.asarray(rows)[ids.cpu().numpy()]),
                               sliced(lm_head, ids, "cpu", torch.float32), None, quant8.isa(flags=plan.flags))
    except KernelUnavailable:  # the dense rows then; nothing the user chose is lost
        return None, None
    return mm, (f"{draft_vocab.describe(ids.numel(), rows.shape[0])}: the GGUF's {kind} blocks of those rows times "
                f"int8 rows ({mm.nbytes / 1e6:.1f} MB read per block)")
