"""The training forward over every block of a sequence, with attention split in two parts.

The draft's inference forward (backends/torch_backend/draft.py, `TorchDraft.propose`) runs one block of B
tokens against the cached context K/V. `TorchDraft.denoise` trains many blocks at once by putting them all
in one attention over [context | all blocks] with a mask: with n blocks per sequence that matrix is
[n*B, S + n*B] and almost all of it masked (a block sees only its own B rows of the n*B). With every
anchor of a sequence trained (n ~ 200) it would be most of the step.

Here the two parts are computed apart and merged exactly:
- block vs context: the B queries of block j against the context keys strictly before its anchor a_j.
  Blocks are sorted by anchor and cut into groups; a group's queries meet only the keys up to its last
  anchor (the rest of the waste is a causal-prefix mask inside the group);
- within block: B x B scores of each block against its own keys (bidirectional, as at inference).
The softmax runs over the two score sets side by side ([B, S_group + B] per block): the same as a
log-sum-exp merge of the two partial attentions, written as one softmax so autograd handles it.

Blocks may be shorter than B (`lengths`): a block of L keeps its first L rows as keys, as `propose(size=L)`
runs it (the block-size controller drafts 2..B); its rows from L on are computed and ignored by the loss.

Everything else is the draft layer as inference computes it: fc + hidden_norm on the context features,
q/k norms, RoPE at the block's true positions, SwiGLU, pre-norm residuals, the final norm. The weights are
read from the trainer's parameters under their z-lab names, so what trains is what `write_draft` saves and
`load_draft` runs; tests/test_train.py checks this forward against the runtime's `propose`, block by block.
Only the plain DFlash format (bidirectional block attention, no embedding scale) is computed here; the
trainer uses `TorchDraft.denoise` for anything else and says so."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_sd.backends.torch_backend.layers import Rope, apply_rope, rms_norm

GROUP = 32  # blocks per context group: the fastest on the 2-core EPYC (benchmarks/train_throughput.py)
# On a GPU a group of 32 is a dozen tiny kernels: ~190 groups a layer for 32 packed sequences made a step
# launch-bound. Larger groups waste masked scores (a group's keys span up to its last anchor) that a GPU
# computes for less than the launches cost. On an H200, 4 layers, 64 sequences a step: group 32 3.23 s a step,
# 256 0.58 s (16 GB), 1024 0.51 s (27 GB). 256 is the default for its memory; --attention-group 1024 where the
# GPU holds it.
GPU_GROUP = 256


def default_group(device) -> int:
    return GROUP if torch.device(device).type == "cpu" else GPU_GROUP


def supports(cfg) -> bool:
    """Whether this forward computes the draft `cfg` (a DraftConfig) exactly as inference does."""
    fmt = cfg.format
    return fmt.name == "dflash" and fmt.input_embedding_scale == 1.0 and all(a.plain for a in fmt.attention)


class SplitForward:
    """hidden = SplitForward(model)(features, tokens, anchors[, lengths, starts]): [n, B-1, H] for block
    positions 1..B-1, final-normed (what the lm_head turns into draft logits), as `TrainingDraft.__call__`
    returns. lengths [n] (default all B): each block's length, 2..B. starts [n]: sequences packed end to end
    (`--pack`), each anchor's sequence start (default: one sequence)."""

    def __init__(self, model, group: int | None = None):
        self.model, self.group = model, group or default_group(model.device)
        arch = model.cfg.arch
        self.arch, self.eps = arch, arch.rms_norm_eps
        self.nh, self.nkv, self.hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.rope = Rope(arch, model.device, torch.float32)
        self.names = {name for name, _ in model.named_parameters()}

    def w(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name)

    def __call__(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                 lengths: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> torch.Tensor:
        m, b = self.model, self.model.block_size
        dev = m.device
        features, tokens, anchors = features.to(dev), tokens.to(dev), anchors.to(dev)
        order = torch.argsort(anchors)
        anchors_sorted = anchors[order]
        n, s = anchors.shape[0], features.shape[0]
        # packed sequences (`starts` [n]: each anchor's sequence start): positions count from a sequence's
        # start, and a block's context keys are its own sequence's, [start, anchor)
        starts_sorted = torch.zeros_like(anchors_sorted) if starts is None else starts.to(dev)[order]
        ctx_pos = torch.arange(s, device=dev)
        if starts is not None:
            firsts = torch.unique(starts_sorted)  # tokens of a sequence without anchors are never keys
            ctx_pos = ctx_pos - firsts[torch.searchsorted(firsts, ctx_pos, right=True).clamp_min(1) - 1]
        context = rms_norm(features.to(self.w("fc.weight").dtype) @ self.w("fc.weight").t(),
                           self.w("hidden_norm.weight"), self.eps)  # [S, H]
        ids = torch.full((n, b), m.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = tokens[anchors_sorted]
        h = F.embedding(ids, m.embed)  # [n, B, H]
        positions = (anchors_sorted - starts_sorted)[:, None] + torch.arange(b, device=dev)
        cos_all, sin_all = self.rope.at(0, max(int(ctx_pos.max()), int(positions.max())) + 1)
        ctx_cos, ctx_sin = cos_all[ctx_pos], sin_all[ctx_pos]
        cos, sin = cos_all[positions][:, None], sin_all[positions][:, None]  # [n, 1, B, hd]
        # keys past a short block's length: out of its attention ([n, B], True = hidden)
        cut = None if lengths is None else torch.arange(b, device=dev)[None, :] >= lengths.to(dev)[order][:, None]
        # each group's key span [lo, hi) (its blocks' earliest sequence start, its latest anchor), read once for
        # all layers: one host sync a forward, not two per group and layer
        group_of = torch.arange(n, device=dev) // self.group
        groups = -(-n // self.group)
        lo = starts_sorted.new_zeros(groups).scatter_reduce(0, group_of, starts_sorted, "amin", include_self=False)
        hi = anchors_sorted.new_zeros(groups).scatter_reduce(0, group_of, anchors_sorted, "amax", include_self=False)
        spans = torch.stack([lo, hi], 1).tolist()
        for i in range(self.arch.num_hidden_layers):
            h = self.layer(i, h, context, ctx_cos, ctx_sin, cos, sin, anchors_sorted, cut, starts_sorted, spans)
        out = rms_norm(h[:, 1:], self.w("norm.weight"), self.eps)
        return out[torch.argsort(order)]  # back to the caller's anchor order

    def qk_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        key = f"{name}.weight"
        return rms_norm(x, self.w(key), self.eps) if key in self.names else x

    def layer(self, i, h, context, ctx_cos, ctx_sin, cos, sin, anchors, cut, starts, spans):
        p = f"layers.{i}."
        n, b, hid = h.shape
        wq, wk, wv = (self.w(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        # Context K/V: once per sequence, as add_context computes them (no input norm on the fused features).
        kc = self.qk_norm((context @ wk.t()).view(-1, self.nkv, self.hd).transpose(0, 1), p + "self_attn.k_norm")
        kc = apply_rope(kc, ctx_cos, ctx_sin)  # [nkv, S, hd]
        vc = (context @ wv.t()).view(-1, self.nkv, self.hd).transpose(0, 1)
        x = rms_norm(h, self.w(p + "input_layernorm.weight"), self.eps)
        q = self.qk_norm((x @ wq.t()).view(n, b, self.nh, self.hd).transpose(1, 2), p + "self_attn.q_norm")
        k = self.qk_norm((x @ wk.t()).view(n, b, self.nkv, self.hd).transpose(1, 2), p + "self_attn.k_norm")
        v = (x @ wv.t()).view(n, b, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [n, heads, B, hd]
        o = self.attention(q, k, v, kc, vc, anchors, cut, starts, spans)  # [n, nh, B, hd]
        h = h + o.transpose(1, 2).reshape(n, b, -1) @ self.w(p + "self_attn.o_proj.weight").t()
        x = rms_norm(h, self.w(p + "post_attention_layernorm.weight"), self.eps)
        gate, up = x @ self.w(p + "mlp.gate_proj.weight").t(), x @ self.w(p + "mlp.up_proj.weight").t()
        return h + (F.silu(gate) * up) @ self.w(p + "mlp.down_proj.weight").t()

    def attention(self, q, k, v, kc, vc, anchors, cut, starts, spans):
        """Each block's queries over [its context prefix | its own block], groups of blocks at a time (sorted
        by anchor: packed sequences stay apart but for a group at a boundary, whose keys span both).
        GQA: the query heads sharing a K/V head are laid out kv-major ([nkv, group, ...]) and multiply that
        head's keys once."""
        n, nh, b, hd = q.shape
        g = nh // self.nkv
        scale = hd ** -0.5
        qg = q.reshape(n, self.nkv, g * b, hd)  # heads kv-major: query head j uses K/V head j // g
        kb, vb = k, v  # [n, nkv, B, hd]
        outs = []
        for first, (lo, hi) in zip(range(0, n, self.group), spans):  # keys lo..hi-1 cover the group's blocks
            sl = slice(first, min(first + self.group, n))
            qs, a = qg[sl], anchors[sl]
            span = hi - lo
            ctx_scores = torch.einsum("nkqd,ksd->nkqs", qs, kc[:, lo:hi]) * scale  # [m, nkv, g*B, span]
            key = torch.arange(lo, hi, device=q.device)[None, :]
            hidden = key >= a[:, None]  # [m, span]: not before the anchor, nor before its sequence's start
            if starts is not None:
                hidden = hidden | (key < starts[sl][:, None])
            ctx_scores = ctx_scores.masked_fill(hidden[:, None, None, :], float("-inf"))
            own = (qs @ kb[sl].transpose(-1, -2)) * scale  # [m, nkv, g*B, B]
            if cut is not None:
                own = own.masked_fill(cut[sl][:, None, None, :], float("-inf"))
            probs = torch.cat([ctx_scores, own], -1).softmax(-1)  # the log-sum-exp merge of both parts
            o = torch.einsum("nkqs,ksd->nkqd", probs[..., :span], vc[:, lo:hi]) + probs[..., span:] @ vb[sl]
            outs.append(o)
        return torch.cat(outs).view(n, nh, b, hd)
