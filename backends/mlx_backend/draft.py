"""The DFlash draft in MLX, the same math as backends/torch_backend/draft.py."""

from __future__ import annotations

import copy

import mlx.core as mx
import torch

from hetero_sd.models import draft_vocab
from hetero_sd.models.config import DraftConfig
from hetero_sd.models.weights import take

from hetero_sd.backends.base import DraftBackend
from hetero_sd.backends.torch_backend.steps import BUCKETS

from . import probe
from .layers import DecoderLayer, KVCache, Rope, evaluated, rms_norm, to_mx
from .steps import DraftSteps, steps_mode
from .target import to_torch


class MLXDraft(DraftBackend):
    device = "mlx"

    def __init__(self, cfg: DraftConfig, tensors: dict, where, embed, lm_head, feature_size: int,
                 mask_token_id: int, dtype=mx.float32, vocab_ids: torch.Tensor | None = None, steps: str = "auto"):
        """embed [vocab, hidden] and lm_head [hidden, vocab]: the target's, as torch or MLX arrays;
        vocab_ids: a reduced head's target ids (hetero_sd/models/draft_vocab.py): only those columns are kept."""
        arch = self.arch = cfg.arch
        self.block_size, self.mask_token_id, self.dtype = cfg.block_size, mask_token_id, dtype
        self.format = cfg.format
        h = arch.hidden_size
        self.fc = to_mx(take(tensors, "fc.weight", (h, feature_size), where).t(), dtype)
        self.hidden_norm = to_mx(take(tensors, "hidden_norm.weight", (h,), where), dtype)
        self.norm = to_mx(take(tensors, "norm.weight", (h,), where), dtype)
        self.layers = [DecoderLayer(arch, tensors, f"layers.{i}.", where, dtype) for i in range(arch.num_hidden_layers)]
        self.embed = evaluated(embed.astype(dtype)) if isinstance(embed, mx.array) else to_mx(embed, dtype)
        self.lm_head = evaluated(lm_head.astype(dtype)) if isinstance(lm_head, mx.array) else to_mx(lm_head, dtype)
        self.vocab_size, self.vocab_ids = self.lm_head.shape[1], vocab_ids
        if vocab_ids is not None:
            self.lm_head = evaluated(mx.take(self.lm_head, mx.array(vocab_ids.numpy()), axis=1))
        self.rope = Rope(arch, dtype)
        self.cache = KVCache(arch, arch.num_hidden_layers, dtype)
        self.last_hidden: torch.Tensor | None = None
        self.steps, _ = steps_mode(steps)  # the block and the catch-up under mx.compile (steps.py)
        self.compiled = DraftSteps(self) if self.steps == "compiled" else None

    @property
    def context_length(self) -> int:
        return self.cache.length

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)

    def fork(self) -> "MLXDraft":
        twin = copy.copy(self)
        twin.cache = self.cache.empty_like()
        twin.compiled = DraftSteps(twin, self.compiled.fns) if self.compiled else None  # (compiled once for both)
        return twin

    def sizes(self) -> tuple[int, int, int]:
        """As the target's: its head (the columns kept) and its layers."""
        a = self.arch
        return probe.sizes(self.lm_head, self.layers, a.num_key_value_heads, a.head_dim, self.dtype)

    def warm(self, positions: int | None) -> int:
        return 0 if self.compiled is None else self.compiled.warm(positions)

    def add_context(self, features: torch.Tensor) -> None:
        start, count = self.cache.length, features.shape[0]
        if self.compiled is not None and count <= BUCKETS[-1]:
            self.compiled.context(to_mx(features, self.dtype), start)
            self.cache.length = start + count
            mx.eval(*self.cache.k, *self.cache.v)
            return
        fused = rms_norm(to_mx(features, self.dtype)[None] @ self.fc, self.hidden_norm, self.arch.rms_norm_eps)
        cos, sin = self.rope.at(start, count)
        for i, layer in enumerate(self.layers):
            k, v = layer.project(fused, cos, sin, queries=False)  # fused features feed k/v directly
            self.cache.write(i, start, k, v)
        self.cache.length = start + count
        mx.eval(*self.cache.k, *self.cache.v)

    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        start, eps = self.cache.length, self.arch.rms_norm_eps
        size = min(size or self.block_size, self.block_size)
        rows = self.format.block_rows(size, self.block_size)  # a short block: as the draft was trained
        if self.compiled is not None:
            hidden, logits = self.compiled.block(anchor, start if position is None else position, rows, size)
        else:
            h = self.embed[mx.array([[anchor] + [self.mask_token_id] * (rows - 1)])]
            cos, sin = self.rope.at(start if position is None else position, rows)
            for i, layer in enumerate(self.layers):
                q, k, v = layer.project(rms_norm(h, layer.in_norm, eps), cos, sin)
                # the block's K/V go after the context but `length` stays: the next context overwrites them
                k, v = self.cache.write(i, start, k, v)
                h = layer.attend(h, q, k, v, None)
            hidden = rms_norm(h[0, 1:size], self.norm, eps)
            logits = hidden @ self.lm_head
        mx.eval(logits, hidden)
        self.last_hidden = to_torch(hidden)
        if self.vocab_ids is not None:  # K scores -> the target's vocabulary, FLOOR elsewhere
            return draft_vocab.expand(to_torch(logits), self.vocab_ids, self.vocab_size)
        return to_torch(logits)
