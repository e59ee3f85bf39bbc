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
from torch import nn

from hetero_sd.models.config import DraftConfig
from hetero_sd.models.weights import take

from ..base import DraftBackend, ModelWeights
from .dflash2 import Selector, conv_layer, layer_convs
from .head import DraftHead, output_logits, sliced  # noqa: F401 (output_logits: its home was here)
from hetero_sd.backends.policy import DEFAULT, LoadPolicy

from .layers import CacheOwner, DecoderLayer, KVCache, Rope, layer_weights, linear, orient, rms_norm, layer_walk, through_layers
from . import fused, quant8
from .cpu import cpu_flags
from .kernels import KernelUnavailable
from .plan import LAYER_MATRICES, plan_matrices
from .steps import BUCKETS, PAST, DraftSteps, steps_mode


class DFlashDraft(nn.Module):
    """The DFlash (and DFlash2) draft as an nn.Module: fc, hidden_norm, the layers (DecoderLayer, with
    DFlash2's convolutions and selector), the final norm as registered buffers; the target's embedding and
    head as buffers it shares (not saved); the multipliers (its own matrices dense or packed, the head the
    target lends it) chosen while it is built. Inference (TorchDraft: a block on the cached context) and
    training (DraftModule: built over the trained parameters, every block in one `denoise`) run its forward."""

    def __init__(self, cfg: DraftConfig, tensors: dict, where, device: str, dtype: torch.dtype,
                 embed: torch.Tensor, lm_head: torch.Tensor, feature_size: int, lm_head_mm=None, pack: bool = True,
                 policy: LoadPolicy = DEFAULT, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        arch = self.arch = cfg.arch
        self.format, h = cfg.format, arch.hidden_size
        self.register_buffer("fc", orient(take(tensors, "fc.weight", (h, feature_size), where).to(device, dtype)))
        self.register_buffer("hidden_norm", take(tensors, "hidden_norm.weight", (h,), where).to(device, dtype))
        self.register_buffer("norm", take(tensors, "norm.weight", (h,), where).to(device, dtype))
        plan = plan_matrices(device, dtype, policy, pack)  # the draft's own matrices: dense or packed
        # where the head already multiplies int8 rows by blocks, the layers do too (plan.draft_blocks)
        int8 = pack and policy.draft_int8_layers and isinstance(lm_head_mm, quant8.Int8Blocks)
        own = plan.draft_blocks if int8 else plan.dense
        multiply = (lambda name, weight_t: own(weight_t)) if pack else None
        self.layers = nn.ModuleList(
            DecoderLayer(arch, layer_weights(tensors, f"layers.{i}.", arch, where, device, dtype), multiply, kv=True)
            for i in range(arch.num_hidden_layers))
        # Shared with the target (lm_head stored [hidden, vocab]); copied only across devices/dtypes.
        self.register_buffer("embed", embed.to(device, dtype), persistent=False)
        self.register_buffer("lm_head", orient(lm_head.t().to(device, dtype)) if vocab_ids is None
                             else sliced(lm_head, vocab_ids, device, dtype), persistent=False)
        self.mm_head = (lm_head_mm if lm_head_mm is not None else plan.dense(self.lm_head)) if pack else self.lm_head
        self.mm_fc = own(self.fc) if pack else self.fc
        self.head = DraftHead(self.mm_head, cfg.format, vocab_ids, lm_head.shape[1])
        self.attend_kernel = block_attend(arch, device, dtype, policy) if pack else None
        # a plain DFlash block on a float32 CPU: the target's fused layer ops (norms, RoPE with the q/k norms and
        # the cache write, SwiGLU in C++; non-causal attention), ~45 torch ops fewer per block (half a block of 2)
        plain = all(a.plain for a in self.format.attention) and all(layer.bqkv is None for layer in self.layers)
        self.fused_ops = (fused.FusedLayerOps(arch, True, self.attend_kernel[1], causal=False)
                          if self.attend_kernel is not None and plain and self.format.name != "dflash2" else None)
        self.walk = layer_walk(self.layers, self.norm)
        note = layers_note(self) if int8 else None
        self.notes: list[str] = [*plan.notes, *([note] if note else [])]
        # DFlash2 (dflash2.py): convolutions around each layer's sublayers, and the candidate selector.
        dflash2 = self.format.name == "dflash2"
        self.convs = layer_convs(tensors, cfg, where, device, dtype) if dflash2 else None
        self.selector = Selector(tensors, cfg, where, device, dtype) if dflash2 else None

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Context features [T, L*H] -> [1, T, H]: what every layer's k/v projection reads."""
        return rms_norm(linear(features.to(self.fc.device, self.fc.dtype)[None], self.mm_fc), self.hidden_norm,
                        self.arch.rms_norm_eps)

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [1, T] ([anchor, mask, ...] per block) -> the layers' input [1, T, H]."""
        h = F.embedding(ids, self.embed)
        return h * self.format.input_embedding_scale if self.format.input_embedding_scale != 1.0 else h

    def add_context(self, features: torch.Tensor, cache: KVCache, start: int, cos, sin) -> None:
        """Context features [T, L*H] fused and projected to every layer's K/V, written to `cache` at start..:
        on the fused ops where the block runs on them (a few C++ calls instead of ~50 torch ops per catch-up,
        which a decoding step pays before every block), else in torch ops."""
        ops = self.fused_ops
        if ops is None:
            fused = self.fuse(features)
            for i in range(len(self.layers)):
                cache.write(i, start, *self.context_kv(fused, cos, sin, i))
            return
        fused = ops.norm(linear(features.to(self.fc.device, self.fc.dtype)[None], self.mm_fc), self.hidden_norm)
        for i, layer in enumerate(self.layers):
            ops.context_kv(layer, fused, cache, i, start, cos, sin)

    def context_kv(self, fused: torch.Tensor, cos, sin, i: int):
        """Layer i's K/V of the fused context features (no input norm on them: they feed k/v directly)."""
        return self.layers[i].project_kv(fused, cos, sin)

    def forward(self, h: torch.Tensor, cos, sin, write, masks, attend=None) -> torch.Tensor:
        """The block's rows h [1, T, H] through the layers (not yet final-normed). write(i, k, v): stores
        layer i's block K/V after the context and returns all keys and values; masks: per layer. attend(i, q):
        layer i's attention output [1, T, nh*D] over what write stored (the C++ kernel), for unmasked layers."""
        eps = self.arch.rms_norm_eps
        for i, layer in enumerate(self.layers):
            if self.convs is not None:
                h = conv_layer(layer, self.convs[i], h, cos, sin, partial(write, i), masks[i])
                continue
            q, k, v = layer.project_qkv(rms_norm(h, layer.in_norm, eps), cos, sin)
            keys, values = write(i, k, v)
            if attend is not None and masks[i] is None:
                h = layer.finish(h, linear(attend(i, q), layer.mm_o))
            else:
                h = layer.attend(h, q, keys, values, masks[i])
        return h

    def denoise(self, features: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Blocks on a context without the cache, differentiably (training runs every block of a sequence
        in one pass): context `features` [S, L*H] at positions 0..S-1; block rows `block_ids` [R] at
        `positions` [R]; `mask` [R, S + R]: which keys (context, then block rows) each row sees. Returns
        the final hidden states [R, H] (what `propose` turns into logits). With one block and a mask
        that shows it the context before its anchor, this is `propose` (the training tests check it)."""
        context = self.fuse(features)
        ctx_cos, ctx_sin = rope.at(0, features.shape[0])
        cos, sin = (table[positions] for table in rope.at(0, int(positions.max()) + 1))

        def write(i, k, v):  # the context's K/V as add_context computes them, then the block's
            k_ctx, v_ctx = self.context_kv(context, ctx_cos, ctx_sin, i)
            return torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2)

        h = self(self.embed_block(block_ids[None]), cos, sin, write, [mask] * len(self.layers))
        return rms_norm(h[0], self.norm, self.arch.rms_norm_eps)


def block_attend(arch, device: str, dtype: torch.dtype, policy: LoadPolicy):
    """(the fused attention kernel, its AVX-512 flag) for a float32 CPU draft, else None (torch's SDPA): a block
    of 2-16 rows over a few hundred context keys, where SDPA's setup is most of the cost (measured 26% of a
    block of 4 on a 512-token context, 2-core EPYC AVX2). The kernel sums each row as torch does not, so the
    draft's logits move by float rounding; its proposals are what the target verifies."""
    if not policy.fused or device != "cpu" or dtype != torch.float32 or arch.head_dim not in (64, 128):
        return None
    flags = cpu_flags()
    try:
        ext = fused.extension()
    except KernelUnavailable:
        return None
    if not ext.has_attend or not {"avx2", "fma"} <= flags:
        return None
    return ext.attend, "avx512f" in flags


def layers_note(draft: DFlashDraft) -> str | None:
    """What the draft's own matrices are (None: all in the draft's float dtype)."""
    mms = [draft.mm_fc] + [getattr(layer, a) for layer in draft.layers for a in ("mm_qkv", "mm_o", "mm_gate_up", "mm_down", "mm_kv")]
    blocks = [m for m in mms if isinstance(m, quant8.Int8Blocks)]
    if not blocks:
        return None
    return (f"draft layers: {len(blocks)} matrices as {blocks[0].kind} blocks quantized at load x int8 rows "
            f"({sum(m.nbytes for m in blocks) / 1e6:.1f} MB instead of "
            f"{sum(m.n * m.k * 4 for m in blocks) / 1e6:.1f} MB of float32; HETERO_SD_DRAFT_LAYERS=q4_1 or float for others)")


class TorchDraft(CacheOwner, DraftBackend):
    """The backend seam's draft on torch: the DFlashDraft module, its KV cache of the context and RoPE
    tables; `add_context`, `propose` (one block on the cached context) and, for training, `denoise`."""

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
        m = self.model = DFlashDraft(cfg, tensors, where, device, dtype, embed, lm_head, feature_size, lm_head_mm,
                                     pack, policy, vocab_ids)
        # what the rest of the runtime reads (floors, the ANE graph, drift, tests)
        self.fc, self.hidden_norm, self.norm, self.layers = m.fc, m.hidden_norm, m.norm, m.layers
        self.embed, self.lm_head, self.mm_head, self.mm_fc, self.head = m.embed, m.lm_head, m.mm_head, m.mm_fc, m.head
        self.format, self.convs, self.selector = m.format, m.convs, m.selector
        self.notes: list[str] = m.notes + ([head_note] if head_note and pack else [])
        self.rope = Rope(arch, device, dtype)
        self.last_hidden: torch.Tensor | None = None
        self.feature_size = feature_size
        # the block and the context catch-up at fixed shapes (captured on CUDA): a plain DFlash draft on torch ops
        torch_ops = (m.fused_ops is None and m.convs is None and m.selector is None and pack
                     and all(a.plain for a in self.format.attention))
        matrices = [m.mm_fc, m.head.mm] + [getattr(layer, a) for layer in m.layers for a in LAYER_MATRICES]
        self.steps, note = steps_mode(policy.steps, device, torch_ops, not any(callable(x) for x in matrices))
        if note:
            self.notes.append(f"draft: {note}")
        # (fixed steps: room for a block's and a padded catch-up's rows past the context, as the target's)
        self.cache = KVCache(arch, arch.num_hidden_layers, device, dtype, max_context + PAST * (self.steps != "eager"))
        self.fixed = self.fixed_steps()

    def fixed_steps(self) -> DraftSteps | None:
        if self.steps == "eager":
            return None
        return DraftSteps(self.model, self.cache, self.rope, self.feature_size, self.block_size, self.steps,
                          partial(self.format.block_rows, block_size=self.block_size))

    @torch.inference_mode()
    def warm(self, positions: int | None) -> int:
        return 0 if self.fixed is None else self.fixed.warm(positions, self.mask_token_id)

    @property
    def context_length(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def add_context(self, features: torch.Tensor) -> None:
        start, count = self.cache.length, features.shape[0]
        self.cache.reserve(start + count + self.block_size)
        if self.fixed is not None and count <= BUCKETS[-1]:
            self.fixed.context(features, start)
        else:
            self.model.add_context(features, self.cache, start, *self.rope.at(start, count))
        self.cache.length = start + count

    def weights(self) -> ModelWeights:
        return ModelWeights(self.arch, self.embed, self.lm_head, self.norm, self.layers,
                            self.cache.bytes_per_position(), self.rope, self.fc, self.hidden_norm, self.format,
                            read_bytes=self.read_bytes(), draft_vocab=self.head.ids,
                            peak=partial(quant8.peak_probe, [getattr(layer, mm) for layer in self.layers
                                                              for mm in ("mm_qkv", "mm_o", "mm_gate_up", "mm_down")]))

    def read_bytes(self) -> int | None:
        """Weight bytes a block reads when its head is the target's GGUF blocks (the cost floor), else None."""
        if not getattr(self.mm_head, "blocks", False):
            return None
        mats = [(getattr(layer, w), getattr(layer, mm)) for layer in self.layers
                for w, mm in (("wqkv", "mm_qkv"), ("wo", "mm_o"), ("w_gate_up", "mm_gate_up"), ("w_down", "mm_down"))]
        return self.mm_head.nbytes + sum(mm.nbytes if isinstance(mm, quant8.Int8Blocks) else w.numel() * w.element_size()
                                         for w, mm in mats)

    def fork(self) -> "TorchDraft":
        twin = copy.copy(self)
        twin.cache = self.cache.empty_like()
        twin.fixed = twin.fixed_steps()  # its own cache: its own captured steps
        return twin

    @torch.inference_mode()
    def propose(self, anchor: int, position: int | None = None, size: int | None = None):
        """Logits [size-1, vocab]; for DFlash2, a SelectorBlock (its logits and the selector's walk)."""
        start, eps, size = self.cache.length, self.arch.rms_norm_eps, min(size or self.block_size, self.block_size)
        position = start if position is None else position
        rows = self.format.block_rows(size, self.block_size)  # a short block: as the draft was trained
        if self.fixed is not None:
            self.last_hidden, logits = self.fixed.block(anchor, self.mask_token_id, position, start, rows, size)
            return logits
        ids = torch.full((1, rows), self.mask_token_id, device=self.device)
        ids[0, 0] = anchor
        # Cache slots follow the context; RoPE carries the true positions. The block's K/V go after the
        # context and are never kept (length is not advanced).
        cos, sin = self.rope.at(position, rows)
        if self.model.fused_ops is not None:  # the layers and the final norm on the fused ops
            x, _ = through_layers(self.model.fused_ops, self.model.walk, self.model.embed_block(ids),
                                  self.layers[0].in_norm, self.cache, start, cos, sin, None)
            self.last_hidden = x[0, 1:size]
            return self.head(self.last_hidden)
        masks = block_masks(self.format.attention, start, position, rows, self.device)
        attend = None
        if self.model.attend_kernel is not None and self.convs is None:
            kernel, wide = self.model.attend_kernel
            attend = lambda i, q: kernel(q.contiguous(), self.cache.k[i], self.cache.v[i], start, wide, False)  # noqa: E731
        h = self.model(self.model.embed_block(ids), cos, sin, lambda i, k, v: self.cache.write(i, start, k, v), masks,
                       attend)
        self.last_hidden = rms_norm(h[0, 1:size], self.norm, eps)  # for precision-drift measurements
        logits = self.head(self.last_hidden)  # [size-1, vocab] float32, whole head or reduced (head.py)
        return logits if self.selector is None else self.selector.block(self.last_hidden, logits, anchor)


    def denoise(self, features: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """DFlashDraft.denoise on this draft's RoPE tables (training; see there)."""
        return self.model.denoise(features, block_ids, positions, mask, self.rope)


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
