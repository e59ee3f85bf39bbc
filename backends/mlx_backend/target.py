"""The frozen target in MLX: one forward per prefill or verify, hidden states captured on the way."""

from __future__ import annotations

import copy
from typing import Sequence

import mlx.core as mx
import numpy as np
import torch

from hetero_sd.models.config import ArchConfig
from hetero_sd.errors import PromptTooLongError
from hetero_sd.models.weights import take

from hetero_sd.backends.base import TargetBackend, TargetOutput, gather_features
from hetero_sd.backends.torch_backend.steps import BUCKETS

from . import probe
from .layers import DecoderLayer, KVCache, Rope, rms_norm, to_mx
from .steps import TargetSteps, steps_mode


def to_torch(x: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(x.astype(mx.float32)))


class MLXTarget(TargetBackend):
    device = "mlx"

    def __init__(self, cfg: ArchConfig, tensors: dict, where, layer_ids: Sequence[int] = (),
                 max_context: int | None = None, dtype=mx.float32, steps: str = "auto"):
        self.config, self.layer_ids, self.dtype = cfg, list(layer_ids), dtype
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        h, v = cfg.hidden_size, cfg.vocab_size
        embed = take(tensors, "model.embed_tokens.weight", (v, h), where)
        head = embed if cfg.tie_word_embeddings else take(tensors, "lm_head.weight", (v, h), where)
        self.embed, self.lm_head = to_mx(embed, dtype), to_mx(head.t(), dtype)  # lm_head [hidden, vocab]
        self.norm = to_mx(take(tensors, "model.norm.weight", (h,), where), dtype)
        self.layers = [DecoderLayer(cfg, tensors, f"model.layers.{i}.", where, dtype) for i in range(cfg.num_hidden_layers)]
        self.rope = Rope(cfg, dtype)
        self.cache = KVCache(cfg, cfg.num_hidden_layers, dtype)
        self.steps, _ = steps_mode(steps)  # decode/verify under mx.compile (steps.py)
        self.compiled = TargetSteps(self) if self.steps == "compiled" else None
        self.mode = "mx.compile steps" if self.compiled else None

    @property
    def length(self) -> int:
        return self.cache.length

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)

    def fork(self) -> "MLXTarget":
        twin = copy.copy(self)
        twin.cache = self.cache.empty_like()
        twin.compiled = TargetSteps(twin, self.compiled.fns) if self.compiled else None  # (compiled once for both)
        return twin

    def sizes(self) -> tuple[int, int, int]:
        """(weight bytes a forward reads, matmul parameters per row, KV bytes per position): the cost floors'."""
        c = self.config
        return probe.sizes(self.lm_head, self.layers, c.num_key_value_heads, c.head_dim, self.dtype)

    def warm(self, positions: int | None) -> int:
        return 0 if self.compiled is None else self.compiled.warm(positions)

    def forward(self, token_ids: Sequence[int], *, last_only: bool = False, features: bool = True) -> TargetOutput:
        start, count = self.cache.length, len(token_ids)
        if start + count > self.max_context:
            raise PromptTooLongError(f"{start + count} positions exceed the target's context of {self.max_context}",
                                     "shorten the prompt or lower max_new_tokens")
        if self.compiled is not None and count <= BUCKETS[-1]:
            logits, feats = self.compiled(token_ids, start, features)
            self.cache.length = start + count
            logits = logits[-1:] if last_only else logits
            # the cache's writes too: nothing the next job (maybe on another thread) reads is left uncomputed
            mx.eval(logits, *([feats] if feats is not None else []), *self.cache.k, *self.cache.v)
            return TargetOutput(to_torch(logits), None if feats is None else to_torch(feats))
        h = self.embed[mx.array([list(token_ids)])]
        cos, sin = self.rope.at(start, count)
        mask = None if count == 1 else causal_mask(start, count, self.dtype)
        captured = []
        for i, layer in enumerate(self.layers):
            q, k, v = layer.project(rms_norm(h, layer.in_norm, self.config.rms_norm_eps), cos, sin)
            keys, values = self.cache.write(i, start, k, v)
            h = layer.attend(h, q, keys, values, mask)
            if features and i in self.layer_ids:
                captured.append(h)
        self.cache.length = start + count
        normed = rms_norm(h[0, -1:] if last_only else h[0], self.norm, self.config.rms_norm_eps)
        logits = normed @ self.lm_head
        feats = self.gather(captured) if features else None
        mx.eval(logits, *([feats] if feats is not None else []))
        return TargetOutput(to_torch(logits), None if feats is None else to_torch(feats))

    def gather(self, captured: list[mx.array]) -> mx.array | None:
        return gather_features(self.layer_ids, captured, self.config.num_hidden_layers,
                               lambda h: rms_norm(h, self.norm, self.config.rms_norm_eps), mx.concatenate)


def causal_mask(start: int, count: int, dtype) -> mx.array:
    rows = mx.arange(count)[:, None] + start
    allowed = mx.arange(start + count)[None, :] <= rows
    return mx.where(allowed, 0.0, -1e9).astype(dtype)
