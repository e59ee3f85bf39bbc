"""The frozen target on torch: one forward per prefill or verify, hidden states captured on the way."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from hetero_sd.models.config import ArchConfig
from hetero_sd.errors import ConfigError, PromptTooLongError
from hetero_sd.models.weights import converted_from, take

from ..base import ModelWeights, TargetBackend, TargetOutput, feature_parts
from . import fused
from .gemm import KernelUnavailable, Packed
from .quant import Quantized, attach as attach_quantized
from .quant8 import Int8Blocks
from .layers import CacheOwner, DecoderLayer, KVCache, Rope, layer_weights, linear, multiplier, orient, rms_norm


class TorchTarget(CacheOwner, TargetBackend):
    def __init__(self, cfg: ArchConfig, tensors: dict, where: Path, device: str, dtype: torch.dtype,
                 layer_ids: Sequence[int] = (), max_context: int | None = None, activations: str = "float32"):
        self.config, self.device, self.dtype = cfg, device, dtype
        self.numerics = activations if activations != "float32" else dtype_name(dtype)  # e.g. "int8"
        self.layer_ids = list(layer_ids)
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed = take(tensors, "model.embed_tokens.weight", (v, h), where).to(device, dtype)
        head = self.embed if cfg.tie_word_embeddings else take(tensors, "lm_head.weight", (v, h), where)
        self.lm_head = orient(head.to(device, dtype))  # [hidden, vocab] as layers.linear takes it
        self.norm = take(tensors, "model.norm.weight", (h,), where).to(device, dtype)
        self.notes: list[str] = []  # announced by the runtime (e.g. a kernel that did not build)
        self.mm_head = multiplier(self.lm_head, self.notes)
        self.layers = [DecoderLayer(cfg, layer_weights(tensors, f"model.layers.{i}.", cfg, where, device, dtype), self.notes)
                       for i in range(cfg.num_hidden_layers)]
        # A target converted from a GGUF multiplies decode/verify rows by the GGUF's own blocks (quant.py)
        self.head_blocks, self.int8_head = None, None
        self.weight_format = self.attach_blocks(converted_from(where), activations) or dtype_name(dtype)
        self.rope = Rope(cfg, device, dtype)
        self.cache = KVCache(cfg, cfg.num_hidden_layers, device, dtype, self.max_context)
        self.fused, why_not = fused.fusable(self)  # a layer in ~12 calls instead of ~50 (fused.py)
        self.notes += [why_not] if why_not else []
        # named in the cost probe and its cache key (costs.backend_dtype): what a step's cost depends on
        named = [self.weight_format] * (self.weight_format != dtype_name(dtype)) + ["fused layer ops"] * self.fused
        self.mode = ", ".join(named) or self.weight_format

    def attach_blocks(self, gguf, activations: str) -> str | None:
        """The GGUF's blocks as the decode/verify multipliers (quant.py); int8 rows (quant8.py) only on request,
        and then never silently without them."""
        if activations == "float32":
            return attach_quantized(self, gguf)
        if gguf is None or self.device != "cpu" or self.dtype != torch.float32:
            raise ConfigError(f"--dtype {activations} needs a CPU target converted from a Q4_1/Q8_0 GGUF",
                              "use the embedded default target (--target default), or --dtype float32")
        before = len(self.notes)
        weights = attach_quantized(self, gguf, Int8Blocks)
        if weights is None:
            raise ConfigError(f"--dtype {activations}: {'; '.join(self.notes[before:]) or 'no GGUF blocks'}",
                              "use --dtype float32")
        return weights

    def draft_head(self):
        """What a draft multiplies its block by: this target's head blocks times int8 rows when it has them
        (a draft only proposes, so its logits need not have the target's numerics: at 16 rows that kernel
        is ~2.5x the float32-exact one and reads half the bytes of a bf16 head), else the target's own."""
        if self.head_blocks is None or isinstance(self.mm_head, Int8Blocks):
            return self.mm_head
        if self.int8_head is None:
            try:
                self.int8_head = Int8Blocks(*self.head_blocks, self.mm_head.fallback)
            except KernelUnavailable:  # the target's own head then; nothing the user chose is lost
                self.int8_head = self.mm_head
        return self.int8_head

    def weights(self) -> ModelWeights:
        return ModelWeights(self.config, self.embed, self.lm_head, self.norm, self.layers,
                            self.cache.bytes_per_position(), self.rope, read_bytes=self.quantized_bytes())

    def quantized_bytes(self) -> int | None:
        """Bytes of the matrices a decode step reads when they are GGUF blocks (quant.py), else None."""
        mats = [self.mm_head] + [getattr(layer, a) for layer in self.layers
                                 for a in ("mm_qkv", "mm_o", "mm_gate_up", "mm_down")]
        if not any(isinstance(m, Quantized) for m in mats):
            return None
        return sum(m.nbytes if isinstance(m, (Quantized, Packed)) else m.numel() * m.element_size() for m in mats)

    def fork(self) -> "TorchTarget":
        twin = copy.copy(self)
        twin.cache = self.cache.empty_like()
        return twin

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], *, last_only: bool = False, features: bool = True) -> TargetOutput:
        start, count = self.cache.length, len(token_ids)
        if start + count > self.max_context:
            raise PromptTooLongError(
                f"{start + count} positions exceed the target's context of {self.max_context}",
                "shorten the prompt or lower max_new_tokens")
        self.cache.reserve(start + count)
        h = F.embedding(torch.tensor([list(token_ids)], device=self.device), self.embed)
        cos, sin = self.rope.at(start, count)
        mask = None if count == 1 else self.causal_mask(start, count)
        if self.fused:
            normed, captured = fused.forward_layers(self, h, start, cos, sin, mask, features)
            normed = normed[0, -1:] if last_only else normed[0]
        else:
            normed, captured = self.forward_layers(h, start, cos, sin, mask, features, last_only)
        self.cache.length = start + count
        return TargetOutput(linear(normed, self.mm_head).float(), self.gather(captured) if features else None)

    def forward_layers(self, h, start, cos, sin, mask, features: bool, last_only: bool) -> tuple:
        """The decoder layers in torch ops: (the final norm of the last hidden state [T, H], the hidden
        states captured at the feature layers)."""
        captured = []
        for i, layer in enumerate(self.layers):
            q, k, v = layer.project_qkv(rms_norm(h, layer.in_norm, self.config.rms_norm_eps), cos, sin)
            keys, values = self.cache.write(i, start, k, v)
            h = layer.attend(h, q, keys, values, mask)
            if features and i in self.layer_ids:
                captured.append(h)
        return rms_norm(h[0, -1:] if last_only else h[0], self.norm, self.config.rms_norm_eps), captured

    def gather(self, captured: list[torch.Tensor]) -> torch.Tensor | None:
        if not self.layer_ids:
            return None
        parts = feature_parts(self.layer_ids, captured, self.config.num_hidden_layers,
                              lambda h: rms_norm(h, self.norm, self.config.rms_norm_eps))
        return torch.cat(parts, -1)[0]

    def causal_mask(self, start: int, count: int) -> torch.Tensor:
        rows = torch.arange(count, device=self.device)[:, None] + start
        return torch.arange(start + count, device=self.device)[None, :] <= rows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
