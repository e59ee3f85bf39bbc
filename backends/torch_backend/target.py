"""The frozen target on torch: one forward per prefill or verify, hidden states captured on the way."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from hetero_sd.models.config import ArchConfig
from hetero_sd.errors import PromptTooLongError
from hetero_sd.models.weights import converted_from, take

from ..base import ModelWeights, TargetBackend, TargetOutput, feature_parts
from hetero_sd.backends.policy import DEFAULT, LoadPolicy

from . import fused
from .cpu import cpu_flags
from .layers import CacheOwner, DecoderLayer, KVCache, Rope, TorchOps, layer_weights, linear, orient, rms_norm
from .plan import LAYER_MATRICES, BlocksRefused, WeightPlan, plan_target


class TorchTarget(CacheOwner, TargetBackend):
    def __init__(self, cfg: ArchConfig, tensors: dict, where: Path, device: str, dtype: torch.dtype,
                 layer_ids: Sequence[int] = (), max_context: int | None = None, activations: str = "float32",
                 policy: LoadPolicy = DEFAULT, flags: frozenset[str] | None = None):
        self.config, self.device, self.dtype = cfg, device, dtype
        self.numerics = activations if activations != "float32" else dtype_name(dtype)  # e.g. "int8"
        self.layer_ids = list(layer_ids)
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed = take(tensors, "model.embed_tokens.weight", (v, h), where).to(device, dtype)
        head = self.embed if cfg.tie_word_embeddings else take(tensors, "lm_head.weight", (v, h), where)
        self.lm_head = orient(head.to(device, dtype))  # [hidden, vocab] as layers.linear takes it
        self.norm = take(tensors, "model.norm.weight", (h,), where).to(device, dtype)
        layer_tensors = [layer_weights(tensors, f"model.layers.{i}.", cfg, where, device, dtype)
                         for i in range(cfg.num_hidden_layers)]
        # Every matrix's format decided here, once (plan.py): dense, packed, GGUF blocks, int8 rows
        plan = plan_target(cfg, converted_from(where), device, dtype, activations, policy,
                           cpu_flags() if flags is None else flags)
        try:
            self.build(plan, layer_tensors)
        except BlocksRefused as e:  # blocks that do not stand for these weights: none of them, and say so
            self.build(plan.without_blocks(str(e)), layer_tensors)
        self.notes: list[str] = self.plan.notes  # announced by the runtime (e.g. a kernel that did not build)
        self.weight_format, self.fused = self.plan.weights, self.plan.fused
        # one forward (forward_layers) over either strategy for the layer's steps: torch ops or fused C++ ops
        self.ops = fused.FusedLayerOps(cfg, plan.attend, plan.attend_wide) if self.fused else TorchOps(cfg.rms_norm_eps)
        self.rope = Rope(cfg, device, dtype)
        self.cache = KVCache(cfg, cfg.num_hidden_layers, device, dtype, self.max_context)
        # named in the cost probe and its cache key (costs.backend_dtype): what a step's cost depends on
        named = [self.weight_format] * (self.weight_format != dtype_name(dtype)) + ["fused layer ops"] * self.fused
        self.mode = ", ".join(named) or self.weight_format
        self.weight_plan = self.plan.describe()  # recorded in the runtime's info (info["weight_plan"])
        self.int8_head = None

    def build(self, plan: WeightPlan, layer_tensors: list[dict]) -> None:
        """The layers and the head with the multipliers the plan gives them."""
        self.plan = plan
        self.mm_head = plan.matrix("mm_head", self.lm_head)
        self.layers = [DecoderLayer(self.config, w, lambda name, weight_t, i=i: plan.matrix((i, name), weight_t))
                       for i, w in enumerate(layer_tensors)]
        if plan.blocks:
            made = [m for m in self.matrices() if getattr(m, "blocks", False)]
            numel = sum(w.numel() for w in self.dense_matrices())
            plan.notes.append(plan.blocks_note(made, numel))

    def matrices(self) -> list:
        """What a decode step multiplies by: the head, then each layer's four matrices."""
        return [self.mm_head] + [getattr(layer, a) for layer in self.layers for a in LAYER_MATRICES]

    def dense_matrices(self) -> list[torch.Tensor]:
        return [self.lm_head] + [w for layer in self.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]

    def head_for(self, device: str, dtype: torch.dtype, int8: bool = True) -> tuple[object | None, str | None]:
        """What a draft on (device, dtype) multiplies by this target's head, and a note: the plan's int8-row
        head blocks on the CPU (any dtype: rows go in as float32), else this target's own multiplier where
        the draft's head is this very tensor (no second copy), else None (the draft makes its own)."""
        if int8 and device == "cpu":
            if self.int8_head is None:
                self.int8_head = self.plan.draft_head(self.mm_head, self.lm_head) or False
            if self.int8_head is not False:
                head = self.int8_head
                return head, (f"draft head: the GGUF's {head.kind} head blocks times int8 rows ({head.nbytes / 1e6:.0f} MB "
                              "read per block instead of a bf16 head's 2 bytes per weight; the target verifies every token)")
        return (self.mm_head if (device, dtype) == (self.device, self.dtype) else None), None

    def weights(self) -> ModelWeights:
        return ModelWeights(self.config, self.embed, self.lm_head, self.norm, self.layers,
                            self.cache.bytes_per_position(), self.rope, read_bytes=self.quantized_bytes())

    def quantized_bytes(self) -> int | None:
        """Bytes of the matrices a decode step reads when the plan gave them GGUF blocks (quant.py), else None."""
        return sum(m.nbytes for m in self.matrices()) if self.plan.blocks else None

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
        normed, captured = self.forward_layers(h, start, cos, sin, mask, features)
        normed = normed[0, -1:] if last_only else normed[0]
        self.cache.length = start + count
        return TargetOutput(linear(normed, self.mm_head).float(), self.gather(captured) if features else None)

    def forward_layers(self, h, start: int, cos, sin, mask, features: bool) -> tuple:
        """The decoder layers on embedded tokens h [1, T, H] at positions start.., through the plan's ops:
        (the final norm of the last hidden state [1, T, H], the hidden states captured at the feature layers)."""
        ops, layers, captured = self.ops, self.layers, []
        x = ops.norm(h, layers[0].in_norm)
        for i, layer in enumerate(layers):
            h, x = ops.add_norm(h, ops.attention(layer, x, self.cache, i, start, cos, sin, mask), layer.post_norm)
            # the next layer's input norm, or the final norm after the last layer
            h, x = ops.add_norm(h, ops.mlp(layer, x), layers[i + 1].in_norm if i + 1 < len(layers) else self.norm)
            if features and i in self.layer_ids:
                captured.append(h)
        return x, captured

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
