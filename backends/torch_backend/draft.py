"""The DFlash draft on torch: context features fused once, K/V of the context cached,
the block [anchor, mask, ...] denoised in one pass through the target's embedding and head.
Non-causal by default; per-layer causal or sliding-window masks and the DFlash2 pieces as the
draft's format says (hetero_sd/models/draft_format.py, dflash2.py)."""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from hetero_sd.models.config import DraftConfig
from hetero_sd.models.weights import take

from ..base import DraftBackend, ModelWeights
from .dflash2 import Selector, conv_layer, layer_convs
from .head import DraftHead, output_logits, sliced  # noqa: F401 (output_logits: its home was here)
from hetero_sd.backends.policy import DEFAULT, LoadPolicy

from .layers import CacheOwner, DecoderLayer, KVCache, Rope, layer_weights, linear, orient, rms_norm
from .plan import WeightPlan


class TorchDraft(CacheOwner, DraftBackend):
    """The draft for inference (`add_context`, `propose`: one block on the cached context) and for
    training (`denoise`: many blocks in one differentiable pass, built with pack=False over the
    trained tensors; hetero_sd/train/model.py)."""

    def __init__(self, cfg: DraftConfig, tensors: dict, where: Path, device: str, dtype: torch.dtype,
                 embed: torch.Tensor, lm_head: torch.Tensor, feature_size: int, mask_token_id: int,
                 max_context: int, lm_head_mm=None, pack: bool = True, policy: LoadPolicy = DEFAULT,
                 head_note: str | None = None, vocab_ids: torch.Tensor | None = None):
        """lm_head_mm: what the target's head is multiplied by for this draft (TorchTarget.head_for), else
        the draft packs its own; pack=False: no plan, the tensors as they are (training). vocab_ids: the
        draft's reduced vocabulary (head.py): its head is those rows of lm_head, lm_head_mm their multiplier."""
        arch = self.arch = cfg.arch
        self.device, self.dtype = device, dtype
        self.block_size, self.mask_token_id = cfg.block_size, mask_token_id
        h = arch.hidden_size
        self.fc = orient(take(tensors, "fc.weight", (h, feature_size), where).to(device, dtype))
        self.hidden_norm = take(tensors, "hidden_norm.weight", (h,), where).to(device, dtype)
        self.norm = take(tensors, "norm.weight", (h,), where).to(device, dtype)
        plan = WeightPlan(device, dtype, policy, pack=pack and policy.gemm)  # the draft's own matrices: dense or packed
        plan.note_gemm_off()
        multiply = (lambda name, weight_t: plan.dense(weight_t)) if pack else None
        self.layers = [DecoderLayer(arch, layer_weights(tensors, f"layers.{i}.", arch, where, device, dtype), multiply,
                                    kv=True)
                       for i in range(arch.num_hidden_layers)]
        # Shared with the target (lm_head stored [hidden, vocab]); copied only across devices/dtypes.
        self.embed, self.lm_head = embed.to(device, dtype), orient(lm_head.t().to(device, dtype)) \
            if vocab_ids is None else sliced(lm_head, vocab_ids, device, dtype)
        self.mm_head = (lm_head_mm if lm_head_mm is not None else plan.dense(self.lm_head)) if pack else self.lm_head
        self.mm_fc = plan.dense(self.fc) if pack else self.fc
        self.head = DraftHead(self.mm_head, cfg.format, vocab_ids, lm_head.shape[1])
        self.notes: list[str] = plan.notes + ([head_note] if head_note and pack else [])
        self.rope = Rope(arch, device, dtype)
        self.cache = KVCache(arch, arch.num_hidden_layers, device, dtype, max_context)
        self.last_hidden: torch.Tensor | None = None
        # DFlash2 (dflash2.py): convolutions around each layer's sublayers, and the candidate selector.
        self.format = cfg.format
        dflash2 = self.format.name == "dflash2"
        self.convs = layer_convs(tensors, cfg, where, device, dtype) if dflash2 else None
        self.selector = Selector(tensors, cfg, where, device, dtype) if dflash2 else None

    @property
    def context_length(self) -> int:
        return self.cache.length

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Context features [T, L*H] -> [1, T, H]: what every layer's k/v projection reads."""
        return rms_norm(linear(features.to(self.device, self.dtype)[None], self.mm_fc), self.hidden_norm,
                        self.arch.rms_norm_eps)

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [1, T] ([anchor, mask, ...] per block) -> the layers' input [1, T, H]."""
        h = F.embedding(ids, self.embed)
        return h * self.format.input_embedding_scale if self.format.input_embedding_scale != 1.0 else h

    @torch.inference_mode()
    def add_context(self, features: torch.Tensor) -> None:
        start, count = self.cache.length, features.shape[0]
        self.cache.reserve(start + count + self.block_size)
        fused = self.fuse(features)
        cos, sin = self.rope.at(start, count)
        for i, layer in enumerate(self.layers):
            # The fused features feed every layer's k/v directly: no input norm on them.
            k, v = layer.project_kv(fused, cos, sin)
            self.cache.write(i, start, k, v)
        self.cache.length = start + count

    def weights(self) -> ModelWeights:
        return ModelWeights(self.arch, self.embed, self.lm_head, self.norm, self.layers,
                            self.cache.bytes_per_position(), self.rope, self.fc, self.hidden_norm, self.format,
                            read_bytes=self.read_bytes(), draft_vocab=self.head.ids)

    def read_bytes(self) -> int | None:
        """Weight bytes a block reads when its head is the target's GGUF blocks (the cost floor), else None."""
        if not getattr(self.mm_head, "blocks", False):
            return None
        mats = [getattr(layer, a) for layer in self.layers for a in ("wqkv", "wo", "w_gate_up", "w_down")]
        return self.mm_head.nbytes + sum(m.numel() * m.element_size() for m in mats)

    def fork(self) -> "TorchDraft":
        twin = copy.copy(self)
        twin.cache = self.cache.empty_like()
        return twin

    @torch.inference_mode()
    def propose(self, anchor: int, position: int | None = None, size: int | None = None):
        """Logits [size-1, vocab]; for DFlash2, a SelectorBlock (its logits and the selector's walk)."""
        start, eps, size = self.cache.length, self.arch.rms_norm_eps, min(size or self.block_size, self.block_size)
        position = start if position is None else position
        ids = torch.full((1, size), self.mask_token_id, device=self.device)
        ids[0, 0] = anchor
        h = self.embed_block(ids)
        # Cache slots follow the context; RoPE carries the true positions.
        cos, sin = self.rope.at(position, size)
        masks = block_masks(self.format.attention, start, position, size, self.device)
        for i, layer in enumerate(self.layers):
            # The block's K/V go after the context and are never kept (length is not advanced).
            write = partial(self.cache.write, i, start)
            if self.convs is not None:
                h = conv_layer(layer, self.convs[i], h, cos, sin, write, masks[i])
                continue
            q, k, v = layer.project_qkv(rms_norm(h, layer.in_norm, eps), cos, sin)
            keys, values = write(k, v)
            h = layer.attend(h, q, keys, values, masks[i])
        self.last_hidden = rms_norm(h[0, 1:], self.norm, eps)  # for precision-drift measurements
        logits = self.head(self.last_hidden)  # [size-1, vocab] float32, whole head or reduced (head.py)
        return logits if self.selector is None else self.selector.block(self.last_hidden, logits, anchor)


    def denoise(self, features: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Blocks on a context without the cache, differentiably (training runs every block of a sequence
        in one pass): context `features` [S, L*H] at positions 0..S-1; block rows `block_ids` [R] at
        `positions` [R]; `mask` [R, S + R]: which keys (context, then block rows) each row sees. Returns
        the final hidden states [R, H] (what `propose` turns into logits). With one block and a mask
        that shows it the context before its anchor, this is `propose` (the training tests check it)."""
        eps = self.arch.rms_norm_eps
        context = self.fuse(features)
        h = self.embed_block(block_ids[None])
        ctx_cos, ctx_sin = self.rope.at(0, features.shape[0])
        cos, sin = (table[positions] for table in self.rope.at(0, int(positions.max()) + 1))
        for layer in self.layers:  # the context's K/V as add_context computes them, the block's as propose does
            k_ctx, v_ctx = layer.project_kv(context, ctx_cos, ctx_sin)
            q, k, v = layer.project_qkv(rms_norm(h, layer.in_norm, eps), cos, sin)
            h = layer.attend(h, q, torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2), mask)
        return rms_norm(h[0], self.norm, eps)


def block_masks(attention, start: int, position: int, size: int, device) -> list[torch.Tensor | None]:
    """Per layer, which keys the block's queries see (None: all of them, DFlash's non-causal block).
    Keys are the context (positions 0..start-1) followed by the block (position..position+size-1)."""
    if all(a.plain for a in attention):
        return [None] * len(attention)
    queries = position + torch.arange(size, device=device)[:, None]
    keys = torch.cat([torch.arange(start, device=device), queries[:, 0]])[None, :]
    masks = []
    for a in attention:
        visible = torch.ones(size, start + size, dtype=torch.bool, device=device)
        if a.causal:
            visible &= keys <= queries
        if a.window is not None:
            visible &= queries - keys < a.window
            if not a.causal:
                visible &= keys - queries < a.window
        masks.append(None if a.plain else visible)
    return masks
