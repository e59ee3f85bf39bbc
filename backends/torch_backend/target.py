"""The frozen target on torch: the decoder as one nn.Module (TargetModel) and the backend seam around it
(TorchTarget: the KV cache, one forward per prefill or verify, hidden states captured on the way)."""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetero_sd.models.config import ArchConfig
from hetero_sd.errors import PromptTooLongError
from hetero_sd.models.weights import converted_from, take

from ..base import ModelWeights, TargetBackend, TargetOutput, gather_features, uploaded
from hetero_sd.backends.policy import DEFAULT, LoadPolicy

from . import fused, quant8
from .cpu import cpu_flags
from .layers import (CacheOwner, DecoderLayer, KVCache, Rope, TorchOps, layer_weights, linear, orient, rms_norm,
                     layer_walk, through_layers)
from .plan import LAYER_MATRICES, BlocksRefused, WeightPlan, kv_name, plan_target
from .steps import BUCKETS, PAST, TargetSteps, mode_names, steps_mode


class TargetModel(nn.Module):
    """The target decoder as an nn.Module: embedding, layers, final norm and head as registered buffers (the
    target is frozen), the multipliers and the layer's ops strategy (torch ops or fused C++ ops) chosen by
    the weight plan while it is built. `forward` is the one forward of the target: the runtime's TorchTarget
    (prefill, verify, decode over its KV cache), the cost probe, and batched data generation
    (train/batched.py: slots over one cache, through its own ops strategy) all run it."""

    def __init__(self, cfg: ArchConfig, tensors: dict, where, device: str, dtype: torch.dtype, plan: WeightPlan):
        super().__init__()
        h, v = cfg.hidden_size, cfg.vocab_size
        self.config, self.plan = cfg, plan
        embed = take(tensors, "model.embed_tokens.weight", (v, h), where).to(device, dtype)
        head = embed if cfg.tie_word_embeddings else take(tensors, "lm_head.weight", (v, h), where)
        self.register_buffer("embed", embed)
        self.register_buffer("lm_head", orient(head.to(device, dtype)))  # [hidden, vocab] as layers.linear takes it
        self.register_buffer("norm", take(tensors, "model.norm.weight", (h,), where).to(device, dtype))
        self.mm_head = plan.matrix("mm_head", self.lm_head)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layer_weights(tensors, f"model.layers.{i}.", cfg, where, device, dtype),
                         lambda name, weight_t, i=i: plan.matrix((i, name), weight_t))
            for i in range(cfg.num_hidden_layers))
        # The forward's walk as plain references to the registered weights: nn.Module's attribute lookup costs
        # ~1 us a read, ~100 reads a decode step. Each layer with its post-attention norm and the next norm
        # (the next layer's input norm, or the final norm after the last layer).
        self.walk = layer_walk(self.layers, self.norm)
        self.first_norm = self.layers[0].in_norm
        # the layer's steps: torch ops, or the same steps as fused C++ ops (fused.py), as the plan says
        self.ops = (fused.FusedLayerOps(cfg, plan.attend, plan.attend_wide) if plan.fused
                    else TorchOps(cfg.rms_norm_eps))

    def matrices(self) -> list:
        """What a decode step multiplies by: the head, then each layer's four matrices."""
        return [self.mm_head] + [getattr(layer, a) for layer in self.layers for a in LAYER_MATRICES]

    def forward(self, ids: torch.Tensor, cache, start: int, cos, sin, mask, capture: Sequence[int] = (),
                ops=None) -> tuple:
        """Token ids [rows, T] at positions start.. (cos/sin, mask: theirs) through the layers and the final
        norm, the layers' K/V going into `cache` through the ops strategy (default: the plan's; data
        generation passes its own for slot caches): (the normed last hidden states [rows, T, H], the hidden
        states of the layers in `capture`, in layer order)."""
        return through_layers(ops or self.ops, self.walk, F.embedding(ids, self.embed), self.first_norm, cache,
                              start, cos, sin, mask, capture)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [..., H] -> float32 logits [..., vocab], through the plan's head."""
        return linear(normed, self.mm_head).float()


def build_target(cfg: ArchConfig, tensors: dict, where, device: str, dtype: torch.dtype,
                 plan: WeightPlan) -> TargetModel:
    """The target module on the plan; GGUF blocks that do not stand for these weights: none of them, said."""
    try:
        return TargetModel(cfg, tensors, where, device, dtype, plan)
    except BlocksRefused as e:
        return TargetModel(cfg, tensors, where, device, dtype, plan.without_blocks(str(e)))


class TorchTarget(CacheOwner, TargetBackend):
    """The backend seam's target on torch: the TargetModel, its KV cache and RoPE tables, one forward per
    prefill or verify with the draft's features captured on the way."""

    def __init__(self, cfg: ArchConfig, tensors: dict, where: Path, device: str, dtype: torch.dtype,
                 layer_ids: Sequence[int] = (), max_context: int | None = None, activations: str = "float32",
                 policy: LoadPolicy = DEFAULT, flags: frozenset[str] | None = None):
        self.config, self.device, self.dtype = cfg, device, dtype
        self.numerics = activations if activations != "float32" else dtype_name(dtype)  # e.g. "int8"
        self.layer_ids = list(layer_ids)
        self.capture = frozenset(self.layer_ids)
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # Every matrix's format decided here, once (plan.py): dense, packed, GGUF blocks, int8 rows
        plan = plan_target(cfg, converted_from(where), device, dtype, activations, policy,
                           cpu_flags() if flags is None else flags)
        self.model = build_target(cfg, tensors, where, device, dtype, plan)
        self.plan = self.model.plan  # (without the GGUF blocks if they were refused)
        # what the rest of the runtime reads (the draft shares embed and head; floors read the layers)
        self.embed, self.lm_head, self.norm = self.model.embed, self.model.lm_head, self.model.norm
        self.layers, self.mm_head, self.ops = self.model.layers, self.model.mm_head, self.model.ops
        self.notes: list[str] = list(self.plan.notes)  # announced by the runtime (e.g. a kernel that did not build)
        self.weight_format, self.fused = self.plan.weights, self.plan.fused
        self.rope = Rope(cfg, device, dtype)
        # decode and verify at fixed shapes (captured as CUDA graphs on CUDA): steps.py
        self.steps, note = steps_mode(policy.steps, device, isinstance(self.model.ops, TorchOps),
                                      not any(callable(m) for m in self.model.matrices()))
        if note:
            self.notes.append(note)
        # (fixed steps: room for a padded step's rows past the context, so that none grows a cache allocated whole)
        self.cache = KVCache(cfg, cfg.num_hidden_layers, device, self.plan.kv_dtype or dtype,
                             self.max_context + PAST * (self.steps != "eager"), self.plan.k_q8)
        self.fixed = self.fixed_steps()
        # named in the cost probe and its cache key (costs.backend_dtype): what a step's cost depends on
        named = [self.weight_format] * (self.weight_format != dtype_name(dtype)) + ["fused layer ops"] * self.fused
        named += [kv_name(self.plan)] * (self.plan.kv_dtype == torch.float16)
        named += ["one-call layer walk"] * self.plan.one_call_walk
        named += mode_names(self.steps, device)
        self.mode = ", ".join(named) or self.weight_format
        self.weight_plan = self.plan.describe()  # recorded in the runtime's info (info["weight_plan"])
        self.int8_head = None

    def fixed_steps(self) -> TargetSteps | None:
        if self.steps == "eager":
            return None
        return TargetSteps(self.model, self.cache, self.rope, self.capture, self.gather, self.steps)

    def matrices(self) -> list:
        return self.model.matrices()

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
                            self.cache.bytes_per_position(), self.rope, read_bytes=self.quantized_bytes(),
                            peak=partial(quant8.peak_probe, self.matrices()))

    def quantized_bytes(self) -> int | None:
        """Bytes of the matrices a decode step reads when the plan gave them GGUF blocks (quant.py), else None."""
        return sum(m.nbytes for m in self.matrices()) if self.plan.blocks else None

    def fork(self) -> "TorchTarget":
        twin = copy.copy(self)
        twin.cache = self.cache.empty_like()
        twin.fixed = twin.fixed_steps()  # its own cache: its own captured steps
        return twin

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, token_ids: Sequence[int], *, last_only: bool = False, features: bool = True) -> TargetOutput:
        return self.run(list(token_ids), None, last_only, features)

    def forward_block(self, anchor: int, drafted: torch.Tensor) -> TargetOutput:
        return self.run([anchor], drafted, False, True)

    @torch.inference_mode()
    def run(self, token_ids: list[int], tail: torch.Tensor | None, last_only: bool, features: bool) -> TargetOutput:
        """token_ids, then `tail` (ids already on a device, or None), at positions length.. appended to the cache."""
        start, count = self.cache.length, len(token_ids) + (0 if tail is None else tail.shape[0])
        if start + count > self.max_context:
            raise PromptTooLongError(
                f"{start + count} positions exceed the target's context of {self.max_context}",
                "shorten the prompt or lower max_new_tokens")
        if self.fixed is not None and (count <= BUCKETS[-1] or tail is None):
            if count <= BUCKETS[-1]:
                logits, captured, top = self.fixed(token_ids, start, tail, last_only)
            else:
                (logits, captured), top = self.fixed.prefill(token_ids, start, last_only), None
            self.cache.length = start + count
            return TargetOutput(logits, captured if features else None, top)
        self.cache.reserve(start + count)
        cos, sin = self.rope.at(start, count)
        # a verify's causal mask, where the ops take one (the C++ attention masks its rows itself: ~37 us saved)
        mask = None if count == 1 or not self.model.ops.needs_mask else self.causal_mask(start, count)
        ids = uploaded(torch.tensor([token_ids]), self.device)  # (a pageable copy would wait for the draft's block)
        if tail is not None:
            ids = torch.cat([ids, uploaded(tail, self.device).view(1, -1)], 1)
        normed, captured = self.model(ids, self.cache, start, cos, sin, mask, self.capture if features else ())
        normed = normed[0, -1:] if last_only else normed[0]
        self.cache.length = start + count
        return TargetOutput(self.model.logits(normed), self.gather(captured) if features else None)

    @torch.inference_mode()
    def warm(self, positions: int | None) -> int:
        return 0 if self.fixed is None else self.fixed.warm(positions)

    def gather(self, captured: list[torch.Tensor]) -> torch.Tensor | None:
        return gather_features(self.layer_ids, captured, self.config.num_hidden_layers,
                               lambda h: rms_norm(h, self.norm, self.config.rms_norm_eps), torch.cat)

    def causal_mask(self, start: int, count: int) -> torch.Tensor:
        rows = torch.arange(count, device=self.device)[:, None] + start
        return torch.arange(start + count, device=self.device)[None, :] <= rows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
