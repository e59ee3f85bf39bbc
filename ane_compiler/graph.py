"""The DFlash draft rewritten to be safe in fp16 (reference §6), as one static graph.

Inputs are what the ANE can take: the block's token ids, a window of context features given
explicitly (no stateful KV cache), RoPE tables, and an additive mask for unused window slots.

fp16 safety comes from exact rewrites, not clamps:
- fc + hidden_norm is invariant to a positive per-token scale of its input (RMSNorm(W(x/s)) =
  RMSNorm(Wx) once eps is scaled by 1/s^2), so the host divides each context token's features by
  max|x| in float32 before they enter the graph: target features of ~1e5 (Qwen-family outliers) never
  meet fp16's 65504 limit.
- every RMSNorm divides its input by its own per-token max|x| before any square is taken (same
  invariance), so sums of squares stay <= hidden_size.
- q is scaled by 1/sqrt(head_dim) before q.k; masks add -1e4 (finite in fp16), never finfo(f32).min.

`rounding` decides the arithmetic: identity for float32 (the reference) and for export (Core ML makes
the program fp16); `to_fp16` for ane-sim, which rounds every op's result to fp16 as the ANE does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MASKED = -1.0e4


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest fp16 value (inf beyond 65504), kept in float32 for fast CPU kernels."""
    return x.to(torch.float16).to(x.dtype)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


LAYER = ("wqkv", "bqkv", "wo", "w_gate_up", "w_down", "in_norm", "post_norm", "q_norm", "k_norm")


def holding(tensors: dict, rounding) -> nn.Module:
    """A module whose buffers are these tensors (float32, rounded to the graph's format), for export."""
    m = nn.Module()
    for name, t in tensors.items():
        m.register_buffer(name, None if t is None else rounding(t.detach().float().clone()))
    return m


class SafeDraftGraph(nn.Module):
    def __init__(self, draft, rounding=identity):
        """draft: a loaded backends.torch_backend.TorchDraft (weights are copied as float32)."""
        super().__init__()
        self.arch, self.round = draft.arch, rounding
        self.w = holding({"fc": draft.fc, "hidden_norm": draft.hidden_norm, "norm": draft.norm,
                          "embed": draft.embed, "lm_head": draft.lm_head}, rounding)
        self.layers = nn.ModuleList(holding({n: getattr(b, n) for n in LAYER} | {"wkv": b.wkv, "bkv": b.bkv}, rounding)
                                    for b in draft.blocks)
        self.nq, self.nkv = draft.blocks[0].nq, draft.blocks[0].nkv

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps) -> torch.Tensor:
        r = self.round
        scale = r(x.abs().amax(-1, keepdim=True)).clamp_min(1e-6)
        y = r(x / scale)
        mean_sq = r((y * y).mean(-1, keepdim=True))
        return r(weight * r(y * r(torch.rsqrt(r(mean_sq + r(r(eps / scale) / scale))))))

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], n, self.arch.head_dim).transpose(0, 1)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, half = self.round, x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return r(r(x * cos) + r(rotated * sin))

    def project(self, x, w, cos, sin, queries: bool):
        """Normed input -> (q,) k, v heads with qk-norm and RoPE; queries=False skips q."""
        r, a, nh, nkv = self.round, self.arch, self.arch.num_attention_heads, self.arch.num_key_value_heads
        out = r(x @ (w.wqkv if queries else w.wkv))  # no full-width slice: it exports as an alias op
        if w.bqkv is not None:
            out = r(out + (w.bqkv if queries else w.bkv))
        parts = out.split(([self.nq] if queries else []) + [self.nkv, self.nkv], -1)
        q, (k, v) = (parts[0] if queries else None), parts[-2:]
        k = self.heads(k, nkv)
        if w.k_norm is not None:
            k = self.rms_norm(k, w.k_norm, a.rms_norm_eps)
        k, v = self.rope(k, cos, sin), self.heads(v, nkv)
        if not queries:
            return k, v
        q = self.heads(q, nh)
        if w.q_norm is not None:
            q = self.rms_norm(q, w.q_norm, a.rms_norm_eps)
        return self.rope(r(q * a.head_dim ** -0.5), cos, sin), k, v  # scaled before q.k, not after

    def attend(self, q, keys, values, bias):
        r, groups = self.round, self.arch.num_attention_heads // self.arch.num_key_value_heads
        keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
        scores = r(r(q @ keys.transpose(-1, -2)) + bias)
        return r(r(scores.softmax(-1)) @ values)

    def forward(self, block_ids, *inputs):
        """block_ids [B]; the rest as for `body`."""
        return self.body(self.round(F.embedding(block_ids, self.w.embed)), *inputs)

    def body(self, h, features, feature_eps, ctx_cos, ctx_sin, blk_cos, blk_sin, ctx_bias):
        """h: the block's embeddings [B, hidden]; features [W, F] already divided by their per-token
        max|x|; feature_eps [W, 1] = eps / scale^2; RoPE tables [W or B, head_dim]; ctx_bias [W] (0 or
        MASKED for unused window slots). Returns logits [B-1, vocab] and final normed hidden [B-1, hidden]."""
        r, a = self.round, self.arch
        ctx = self.rms_norm(r(features @ self.w.fc), self.w.hidden_norm, feature_eps)
        bias = torch.cat([ctx_bias, torch.zeros(h.shape[0], dtype=ctx_bias.dtype)])
        for w in self.layers:
            q, k, v = self.project(self.rms_norm(h, w.in_norm, a.rms_norm_eps), w, blk_cos, blk_sin, True)
            ck, cv = self.project(ctx, w, ctx_cos, ctx_sin, False)
            o = self.attend(q, torch.cat([ck, k], 1), torch.cat([cv, v], 1), bias)
            h = r(h + r(o.transpose(0, 1).reshape(h.shape[0], self.nq) @ w.wo))
            gate, up = r(self.rms_norm(h, w.post_norm, a.rms_norm_eps) @ w.w_gate_up).chunk(2, -1)
            h = r(h + r(r(r(F.silu(gate)) * up) @ w.w_down))
        hidden = self.rms_norm(h[1:], self.w.norm, a.rms_norm_eps)
        return r(hidden @ self.w.lm_head), hidden
