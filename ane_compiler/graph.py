"""The DFlash draft rewritten for the Apple Neural Engine (fp16 arithmetic, channels-first),
as one static graph.

Inputs are what the ANE can take: the block's token embeddings, a window of context features given
explicitly (no stateful KV cache), RoPE tables, and an additive mask for unused window slots.

Layout: channels-first (1, C, 1, S) throughout, every linear layer a 1x1 convolution, attention split
per head along the channel axis (grouped-query heads pick their K/V head by index: no tiling), so the
only layout change left is one transpose of each K head.

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
INPUTS = ("block_embeddings", "features", "feature_eps", "ctx_cos", "ctx_sin", "blk_cos", "blk_sin", "ctx_bias")


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest fp16 value (inf beyond 65504), kept in float32 for fast CPU kernels."""
    return x.to(torch.float16).to(x.dtype)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """[S, C] -> [1, C, 1, S]."""
    return x.t()[None, :, None, :]


def sequence_first(x: torch.Tensor) -> torch.Tensor:
    """[1, C, 1, S] -> [S, C]."""
    return x[0, :, 0, :].t()


def holding(tensors: dict, rounding) -> nn.Module:
    """A module whose buffers are these tensors (float32, rounded to the graph's format), for export.
    Weights stored [in, out] (the torch backend's layout) become 1x1 convolution kernels [out, in, 1, 1]."""
    m = nn.Module()
    for name, t in tensors.items():
        if t is not None:
            t = t.detach().float()
            t = t.t().contiguous()[:, :, None, None] if t.dim() == 2 else t[None, :, None, None].clone()
            t = rounding(t)
        m.register_buffer(name, t)
    return m


class SafeDraftGraph(nn.Module):
    def __init__(self, draft, rounding=identity):
        """draft: a loaded draft that exposes its weights (DraftBackend.weights: the torch backend's);
        they are copied as float32."""
        super().__init__()
        w = draft.weights()
        w.format.require_plain("the Neural Engine graph")  # it has no convolution, selector or masks
        self.arch, self.round = w.config, rounding
        self.w = holding({"fc": w.fc, "hidden_norm": w.hidden_norm, "norm": w.norm, "lm_head": w.lm_head}, rounding)
        names = ("wqkv", "bqkv", "wo", "w_gate_up", "w_down", "in_norm", "post_norm", "q_norm", "k_norm")
        self.layers = nn.ModuleList(holding({n: getattr(b, n) for n in names} | {"wkv": b.wkv, "bkv": b.bkv},
                                            rounding) for b in w.layers)
        self.nq, self.nkv, self.hidden = w.layers[0].nq, w.layers[0].nkv, w.config.hidden_size

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.round(F.conv2d(x, weight))
        return y if bias is None else self.round(y + bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps) -> torch.Tensor:
        """Over the channel axis, with the input divided by its own max|x| before the square."""
        r = self.round
        scale = r(x.abs().amax(1, keepdim=True)).clamp_min(1e-6)
        y = r(x / scale)
        mean_sq = r((y * y).mean(1, keepdim=True))
        return r(weight * r(y * r(torch.rsqrt(r(mean_sq + r(r(eps / scale) / scale))))))

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r, half = self.round, x.shape[1] // 2
        rotated = torch.cat([-x[:, half:], x[:, :half]], 1)
        return r(r(x * cos) + r(rotated * sin))

    def heads(self, x: torch.Tensor, norm: torch.Tensor | None, cos, sin, scale: float = 1.0) -> list[torch.Tensor]:
        """[1, n*hd, 1, S] -> n heads [1, hd, 1, S], each qk-normed (if the model does), scaled, rotated."""
        out = []
        for head in x.split(self.arch.head_dim, dim=1):
            if norm is not None:
                head = self.rms_norm(head, norm, self.arch.rms_norm_eps)
            if scale != 1.0:
                head = self.round(head * scale)
            out.append(self.rope(head, cos, sin))
        return out

    def keys_values(self, x, w, cos, sin):
        k, v = self.conv(x, w.wkv, w.bkv).split([self.nkv, self.nkv], 1)
        return self.heads(k, w.k_norm, cos, sin), list(v.split(self.arch.head_dim, dim=1))

    def attention(self, x, ctx, w, blk_cos, blk_sin, ctx_cos, ctx_sin, bias) -> torch.Tensor:
        r, a = self.round, self.arch
        q, k, v = self.conv(x, w.wqkv, w.bqkv).split([self.nq, self.nkv, self.nkv], 1)
        queries = self.heads(q, w.q_norm, blk_cos, blk_sin, a.head_dim ** -0.5)  # scaled before q.k
        keys, values = self.heads(k, w.k_norm, blk_cos, blk_sin), list(v.split(a.head_dim, dim=1))
        ctx_keys, ctx_values = self.keys_values(ctx, w, ctx_cos, ctx_sin)
        groups, out = a.num_attention_heads // a.num_key_value_heads, []
        for i, query in enumerate(queries):
            key = torch.cat([ctx_keys[i // groups], keys[i // groups]], 3).transpose(1, 3)  # [1, Sk, 1, hd]
            value = torch.cat([ctx_values[i // groups], values[i // groups]], 3)  # [1, hd, 1, Sk]
            scores = r(r(torch.einsum("bchq,bkhc->bkhq", query, key)) + bias)  # [1, Sk, 1, Sq]
            weights = r(scores.softmax(1))
            out.append(r(torch.einsum("bkhq,bchk->bchq", weights, value)))
        return self.conv(torch.cat(out, 1), w.wo)

    def forward(self, block_embeddings, features, feature_eps, ctx_cos, ctx_sin, blk_cos, blk_sin, ctx_bias):
        """All channels-first: block_embeddings [1, hidden, 1, B]; features [1, F, 1, W] already divided
        by their per-token max|x|; feature_eps [1, 1, 1, W] = eps / scale^2; RoPE tables [1, head_dim, 1,
        W or B]; ctx_bias [1, W, 1, 1] (0, or MASKED for unused window slots).
        Returns logits [1, vocab, 1, B-1] (a reduced draft head: [1, K, 1, B-1], its lm_head being those
        rows; the host widens them to the vocabulary) and the final normed hidden states [1, hidden, 1, B-1]."""
        r, a = self.round, self.arch
        ctx = self.rms_norm(self.conv(features, self.w.fc), self.w.hidden_norm, feature_eps)
        bias = torch.cat([ctx_bias, torch.zeros(1, block_embeddings.shape[3], 1, 1, dtype=ctx_bias.dtype)], 1)
        h = block_embeddings
        for w in self.layers:
            attended = self.attention(self.rms_norm(h, w.in_norm, a.rms_norm_eps), ctx, w,
                                      blk_cos, blk_sin, ctx_cos, ctx_sin, bias)
            h = r(h + attended)
            gate, up = self.conv(self.rms_norm(h, w.post_norm, a.rms_norm_eps), w.w_gate_up).chunk(2, 1)
            h = r(h + self.conv(r(r(F.silu(gate)) * up), w.w_down))
        hidden = self.rms_norm(h[:, :, :, 1:], self.w.norm, a.rms_norm_eps)
        return self.conv(hidden, self.w.lm_head), hidden
