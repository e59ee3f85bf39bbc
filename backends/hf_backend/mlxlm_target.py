"""A target run by mlx-lm's own model classes (device "mlx"): the families our MLX layers do not
implement, and mlx-lm's 4/8-bit quantized models, as mlx-lm loads them.

Context features: the chosen decoder layers are wrapped to record their outputs; the last layer's goes
through the model's final norm (base.feature_parts). Cache: mlx-lm's own per layer, except that a
sliding-window layer gets a plain KVCache (its mask still applies the window) so that any suffix can be
trimmed. Attention caches are trimmed; recurrent ones (ArraysCache: conv window + state, not trimmable)
are restored from their state at the start of the last forward and the accepted prefix re-run (mlx
arrays are values: keeping the list of state arrays is the snapshot)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hetero_sd.errors import PromptTooLongError
from hetero_sd.models.config import ArchConfig

from ..base import TargetBackend, TargetOutput, feature_parts


class Recorder:
    """Stands in for one decoder layer: calls it and keeps its output (attributes read through)."""

    def __init__(self, layer, sink: dict, index: int):
        self.__dict__.update(_layer=layer, _sink=sink, _index=index)

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._sink[self._index] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):
        return getattr(self._layer, name)


def decoder(model):
    """The module holding `layers` and `norm` (mlx-lm models wrap it as .model, some as .language_model.model)."""
    for path in (("model",), ("language_model", "model"), ()):
        m = model
        for name in path:
            m = getattr(m, name, None)
        if m is not None and hasattr(m, "layers") and hasattr(m, "norm"):
            return m
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


class MLXLMTarget(TargetBackend):
    path = "mlx-lm"

    def __init__(self, model, cfg: ArchConfig, layer_ids: Sequence[int], max_context: int,
                 notes: list[str] | None = None):
        import mlx.core as mx

        self.mx, self.model, self.config, self.device = mx, model, cfg, "mlx"
        self.layer_ids, self.max_context = list(layer_ids), max_context
        self.notes = notes if notes is not None else []
        self.inner = decoder(model)
        self.captured: dict = {}
        for i in sorted(set(self.layer_ids)):
            layer = self.inner.layers[i]
            self.inner.layers[i] = layer if isinstance(layer, Recorder) else Recorder(layer, self.captured, i)
        self.embed = self.as_torch(self.dense(self.inner.embed_tokens))  # [vocab, hidden]: shared with the draft
        head = getattr(model, "lm_head", None) or getattr(getattr(model, "language_model", None), "lm_head", None)
        self.lm_head = (self.as_torch(self.dense(head)) if head is not None else self.embed).t()  # [hidden, vocab]
        self.ids: list[int] = []
        self.reset()

    def dense(self, module):
        """A (possibly quantized) embedding or linear layer's weight as float32 [out, in]."""
        mx = self.mx
        if hasattr(module, "scales"):  # QuantizedEmbedding / QuantizedLinear
            return mx.dequantize(module.weight, module.scales, getattr(module, "biases", None),
                                 module.group_size, module.bits, **({"mode": module.mode} if hasattr(module, "mode") else {}))
        return module.weight.astype(mx.float32)

    def as_torch(self, a) -> torch.Tensor:
        return torch.from_numpy(np.array(a.astype(self.mx.float32)))

    def reset(self) -> None:
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        self.cache = [KVCache() if isinstance(c, RotatingKVCache) else c for c in make_prompt_cache(self.model)]
        self.ids, self.block_start, self.snapshot = [], 0, None

    @property
    def length(self) -> int:
        return len(self.ids)

    def recurrent(self) -> list:
        return [c for c in self.cache if not c.is_trimmable()]

    def run(self, ids: Sequence[int], last_only: bool):
        mx = self.mx
        self.block_start = len(self.ids)
        self.snapshot = [list(c.state[0]) if hasattr(c, "cache") else c.state for c in self.recurrent()]
        self.captured.clear()
        logits = self.model(mx.array([list(ids)]), cache=self.cache)
        logits = logits[:, -1:] if last_only else logits
        mx.eval(logits, *[c.state for c in self.cache])
        self.ids.extend(int(i) for i in ids)
        return logits

    def forward(self, token_ids: Sequence[int], *, last_only: bool = False, features: bool = True) -> TargetOutput:
        if len(self.ids) + len(token_ids) > self.max_context:
            raise PromptTooLongError(f"{len(self.ids) + len(token_ids)} positions exceed the target's context of "
                                     f"{self.max_context}", "shorten the prompt or lower max_new_tokens")
        logits = self.run(token_ids, last_only)
        feats = None
        if features and self.layer_ids:
            captured = [self.captured[i] for i in sorted(set(self.layer_ids))]
            parts = feature_parts(self.layer_ids, captured, self.config.num_hidden_layers, self.inner.norm)
            feats = self.as_torch(self.mx.concatenate(parts, axis=-1)[0])
        return TargetOutput(self.as_torch(logits[0]), feats)

    def crop(self, length: int) -> None:
        length = max(0, int(length))
        if length >= len(self.ids):
            return
        if length == 0:
            self.reset()
            return
        recurrent = self.recurrent()
        if not recurrent:
            for c in self.cache:
                c.trim(len(self.ids) - length)
            del self.ids[length:]
            return
        if length < self.block_start or self.snapshot is None:  # before the last forward: from position 0
            kept = self.ids[:length]
            self.reset()
            self.run(kept, last_only=True)
            return
        start, kept = self.block_start, self.ids[self.block_start:length]
        for c, state in zip(recurrent, self.snapshot):
            if hasattr(c, "cache"):
                c.cache = list(state)
            else:
                c.state = state
        for c in self.cache:
            if c.is_trimmable():
                c.trim(len(self.ids) - start)
        del self.ids[start:]
        if kept:
            self.run(kept, last_only=True)

    def fork(self) -> "MLXLMTarget":
        other = object.__new__(MLXLMTarget)
        other.__dict__.update(self.__dict__)
        other.captured = self.captured  # the recorders write here: forks run one at a time on the mlx lane
        other.reset()
        return other
