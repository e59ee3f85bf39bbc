"""MLX backend: target and DFlash draft in Apple's MLX (Metal GPU on macOS; the CPU on Linux via
`mlx[cpu]`, whose bundled BLAS is slow: fine for checks, not for speed)."""

from __future__ import annotations

from pathlib import Path

from hetero_sd.models.config import ArchConfig, DraftConfig
from hetero_sd.models.weights import load_weights

from .draft import MLXDraft
from .target import MLXTarget

__all__ = ["MLXDraft", "MLXTarget", "load_target", "load_draft"]


def load_target(folder: Path, cfg: ArchConfig, layer_ids=(), max_context: int | None = None,
                steps: str = "auto") -> MLXTarget:
    return MLXTarget(cfg, load_weights(folder), folder, layer_ids, max_context, steps=steps)


def load_draft(folder: Path | None, cfg: DraftConfig, target, mask_token_id: int, tensors: dict,
               steps: str = "auto") -> MLXDraft:
    """The draft shares the target's embedding and lm_head (copied from torch when the target is not MLX).
    Plain DFlash only: DFlash2 and per-layer masks are refused by name. A reduced draft vocabulary is applied."""
    cfg.format.require_plain("the MLX backend")
    feature_size = len(target.layer_ids) * target.config.hidden_size
    return MLXDraft(cfg, tensors, folder, target.embed, target.lm_head, feature_size, mask_token_id,
                    vocab_ids=tensors.get("draft_vocab"), steps=steps)  # a reduced head: those rows only (draft_vocab.py)
