"""What the host does for a compiled draft graph: keep the context features, cut the window, scale each
token's features by its max|x| (float32, exact for fc + RMSNorm), look up the block's embeddings,
build RoPE tables, and hand everything over channels-first. `ane-sim` and the Core ML devices differ
only in who runs the graph."""

from __future__ import annotations

import torch

from hetero_sd.ane_compiler.graph import MASKED, channels_first
from hetero_sd.models import draft_vocab

from ..base import DraftBackend

WINDOW = 512  # context positions given to the graph (a compiled package has exactly this many)


class WindowedDraft(DraftBackend):
    pad = False  # True: fixed shapes (a compiled package): pad the window, mask the unused slots

    def __init__(self, reference, window: int = WINDOW):
        """reference: the loaded float32 draft (the torch backend's), whose declared weights give the
        embeddings, RoPE tables and feature width."""
        w = reference.weights()
        self.embed, self.rope, self.window = w.embed.float(), w.rope, window
        self.block_size, self.mask_token_id = reference.block_size, reference.mask_token_id
        self.format = w.format  # a short block's rows (DraftFormat.block_rows)
        self.eps = w.config.rms_norm_eps
        # a reduced draft head: the graph scores the K ids (its lm_head is those rows); the host widens them
        self.vocab_ids, self.vocab_size = w.draft_vocab, w.embed.shape[0]
        self.features = torch.zeros(0, w.fc.shape[0])
        self.last_hidden: torch.Tensor | None = None

    @property
    def context_length(self) -> int:
        return self.features.shape[0]

    def add_context(self, features: torch.Tensor) -> None:
        self.features = torch.cat([self.features, features.detach().float().cpu()])

    def crop(self, length: int) -> None:
        self.features = self.features[:length]

    def fork(self) -> "WindowedDraft":
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__, features=self.features[:0], last_hidden=None)
        return twin

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The graph's logits [n, K or vocab] -> [n, vocab] (draft_vocab.FLOOR outside a reduced head's ids)."""
        return logits if self.vocab_ids is None else draft_vocab.expand(logits, self.vocab_ids, self.vocab_size)

    def inputs(self, anchor: int, position: int | None, size: int) -> dict[str, torch.Tensor]:
        start = self.context_length if position is None else position
        first = max(0, self.context_length - self.window)
        feats = self.features[first:]
        used = feats.shape[0]
        scale = feats.abs().amax(-1, keepdim=True)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        ids = torch.full((size,), self.mask_token_id)
        ids[0] = anchor
        ctx_cos, ctx_sin = self.rope.at(first, used)
        blk_cos, blk_sin = self.rope.at(start, size)
        x = {"block_embeddings": self.embed[ids], "features": feats / scale, "feature_eps": self.eps / scale ** 2,
             "ctx_cos": ctx_cos.float(), "ctx_sin": ctx_sin.float(), "blk_cos": blk_cos.float(),
             "blk_sin": blk_sin.float(), "ctx_bias": torch.zeros(used, 1)}
        if self.pad and used < self.window:
            extra = self.window - used
            for name in ("features", "ctx_cos", "ctx_sin"):
                x[name] = torch.cat([x[name], torch.zeros(extra, x[name].shape[1])])
            # a positive eps keeps the empty rows' RMSNorm at 0 * finite (0 / sqrt(0) would be NaN)
            x["feature_eps"] = torch.cat([x["feature_eps"], torch.ones(extra, 1)])
            x["ctx_bias"] = torch.cat([x["ctx_bias"], torch.full((extra, 1), MASKED)])
        x = {k: channels_first(v) for k, v in x.items()}
        x["ctx_bias"] = x["ctx_bias"].permute(0, 3, 2, 1)  # [1, W, 1, 1]: keys run along axis 1 of the scores
        return x
