"""A reduced draft vocabulary (EAGLE-3's idea): the draft's head scores only K target tokens.

A DFlash draft multiplies its final hidden states by the target's lm_head: for a small target that head
is most of a draft block's cost (49,152 rows for SmolLM2). A draft folder may instead carry the K target
ids its head scores, and the runtime multiplies only those K rows of the target's head.

Format (a hetero-sd extension of z-lab's; runtimes that ignore it run the same draft with the full head):
- config.json: `dflash_config.draft_vocab_size: K` (or at the top level, by the reference's lookup rule);
- model.safetensors: a tensor `draft_vocab`, integer, shape [K]: distinct target token ids in
  [0, vocab_size), the head's rows in that order (`hetero-sd draft-vocab` writes them ascending).
Both or neither; anything else is refused with the fix.

Lossless: the draft's logits outside the K ids are FLOOR, a finite value so far below any score that
softmax gives them probability exactly 0 (exp underflows) at any temperature the sampler allows. The
draft then proposes only K-set tokens; at T > 0 its q is the distribution actually sampled from (zero
outside the set), which is what rejection sampling needs; the target verifies every token as always.
Finite on purpose: the loop's fault check refuses non-finite draft logits."""

from __future__ import annotations

import torch

from hetero_sd.errors import ConfigError, WeightsError

TENSOR = "draft_vocab"
KEY = "draft_vocab_size"
FLOOR = -1.0e30  # / any temperature >= 1e-4 stays finite in float32; exp(FLOOR - max) == 0
FIX_MAKE = "re-make the reduced draft with `hetero-sd draft-vocab --draft DIR --k K --out DIR2`"


def declared_size(raw: dict, where: str, vocab_size: int | None) -> int | None:
    """K from a draft config (None: the draft scores the whole vocabulary)."""
    value = (raw.get("dflash_config") or {}).get(KEY, raw.get(KEY))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (vocab_size and value > vocab_size):
        raise ConfigError(f"{where}: {KEY} {value!r} is not an integer in 1..{vocab_size or 'vocab_size'}",
                          f"set dflash_config.{KEY} to the length of the draft's {TENSOR} tensor, or {FIX_MAKE}")
    return value


def check_ids(ids: torch.Tensor | None, size: int | None, vocab_size: int, where) -> torch.Tensor | None:
    """The K target ids as int64, or None; refuses a tensor without the key (and the reverse), a wrong
    dtype or shape, ids out of range and duplicates, naming the first offender."""
    if ids is None and size is None:
        return None
    if ids is None:
        raise WeightsError(f"{where}: config declares {KEY} {size} but the weights have no {TENSOR} tensor",
                           f"{FIX_MAKE}, or remove {KEY} from config.json to use the full head")
    if size is None:
        raise WeightsError(f"{where}: the weights hold a {TENSOR} tensor but config.json has no {KEY}",
                           f"add dflash_config.{KEY}: {ids.numel()} to config.json, or {FIX_MAKE}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise WeightsError(f"{where}: tensor {TENSOR} is {str(ids.dtype).removeprefix('torch.')}, not integer ids",
                           FIX_MAKE)
    if ids.dim() != 1 or ids.numel() != size:
        raise WeightsError(f"{where}: tensor {TENSOR} has shape {tuple(ids.shape)}, config says [{size}]", FIX_MAKE)
    ids = ids.to(torch.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise WeightsError(f"{where}: {TENSOR} holds id {int(bad[0])} outside the target's vocabulary "
                           f"(0..{vocab_size - 1}; {bad.numel()} such)", FIX_MAKE)
    unique, counts = ids.unique(return_counts=True)
    if unique.numel() != ids.numel():
        raise WeightsError(f"{where}: {TENSOR} holds id {int(unique[counts > 1][0])} more than once "
                           f"({ids.numel() - unique.numel()} duplicates)", FIX_MAKE)
    return ids


def expand(scores: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, K] scores of the draft's K ids -> [n, vocab] float32 logits, FLOOR elsewhere."""
    scores = scores.float()
    out = torch.full((scores.shape[0], vocab_size), FLOOR, dtype=torch.float32, device=scores.device)
    # scatter_ along the last dim: ~3x faster than index_copy_ across columns on a CPU
    return out.scatter_(1, ids.to(scores.device).expand(scores.shape[0], -1), scores)


def describe(size: int, vocab_size: int) -> str:
    """How stats and notes name the head: 'draft head: 8192 of 49152 rows'."""
    return f"draft head: {size} of {vocab_size} rows (the draft's {TENSOR}; tokens outside it are never proposed)"
