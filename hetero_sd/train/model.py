"""A trainable DFlash draft. Its state_dict is the z-lab checkpoint (fc, hidden_norm, layers.i.*, norm);
the target's embedding and lm_head are used frozen and never saved.

Training puts every block of a sequence into one forward (reference §5): block j, anchored at position
a_j, attends to the context features strictly before a_j and to its own block (bidirectionally), never
to other blocks. With one block this is exactly the inference forward of backends.torch_backend.draft."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, hd, eps = cfg["hidden_size"], cfg["head_dim"], cfg["rms_norm_eps"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm, self.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)

    def forward(self, x, context, rope_q, rope_k, mask):
        """x: [R, H] block rows; context: [S, H] fused features; mask [R, S + R]."""
        rows, kv_in = x.shape[0], torch.cat([context, x])
        q = self.q_norm(self.q_proj(x).view(rows, self.nh, self.hd)).transpose(0, 1)
        k = self.k_norm(self.k_proj(kv_in).view(-1, self.nkv, self.hd)).transpose(0, 1)
        v = self.v_proj(kv_in).view(-1, self.nkv, self.hd).transpose(0, 1)
        q, k = rotate(q, *rope_q), rotate(k, *rope_k)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=self.nh != self.nkv)
        return self.o_proj(o[0].transpose(0, 1).reshape(rows, -1))


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, h, context, rope_q, rope_k, mask):
        h = h + self.self_attn(self.input_layernorm(h), context, rope_q, rope_k, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class TrainableDraft(nn.Module):
    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        h, n_feat = cfg["hidden_size"], len(cfg["dflash_config"]["target_layer_ids"])
        self.cfg, self.block_size = cfg, cfg["block_size"]
        self.mask_token_id = cfg["dflash_config"]["mask_token_id"]
        self.fc = nn.Linear(n_feat * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.frozen = {"embed": embed.detach(), "lm_head": lm_head.detach()}  # not parameters, not saved
        hd = cfg["head_dim"]
        self.inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def rope(self, positions: torch.Tensor):
        ang = torch.outer(positions.double(), self.inv_freq)
        ang = torch.cat([ang, ang], -1).float()
        return ang.cos(), ang.sin()

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """features [S, L*H] of one sequence, tokens [S], anchors [n] (positions): hidden [n, B-1, H]
        for block positions 1..B-1 (what the lm_head turns into draft logits)."""
        b, n, s = self.block_size, anchors.shape[0], features.shape[0]
        context = self.hidden_norm(self.fc(features))
        block_ids = torch.full((n, b), self.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = tokens[anchors]
        h = F.embedding(block_ids.flatten(), self.frozen["embed"])
        block_pos = (anchors[:, None] + torch.arange(b)).flatten()
        rope_q, rope_k = self.rope(block_pos), self.rope(torch.cat([torch.arange(s), block_pos]))
        mask = block_mask(anchors, s, b)
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_k, mask)
        return self.norm(h).view(n, b, -1)[:, 1:]

    def logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> [..., V]; flattened to one 2-D matmul (a 3-D one runs as a slow bmm here).
        `head` replaces the full lm_head, e.g. by its rows for the training vocabulary."""
        head = self.frozen["lm_head"] if head is None else head
        flat = hidden.reshape(-1, hidden.shape[-1]) @ head.t()
        return flat.view(*hidden.shape[:-1], -1)


class TrainingVocab:
    """The loss's softmax over the tokens the labels can take (the target's own answers) plus a fresh
    random sample of the other tokens each step, not over all V.

    On this CPU the lm_head's forward and backward over 49k tokens cost ~70% of a step; SmolLM2's answers
    use ~8k distinct tokens, so a step gets ~3x cheaper (EAGLE-3 trains over a reduced draft vocabulary for
    the same reason). The sampled others keep pushing every token down over the run: without them a token
    never seen in an answer is never penalised and can win the full-vocabulary argmax at inference.
    Inference and the held-out estimate use the full lm_head."""

    def __init__(self, rows: list[dict], lm_head: torch.Tensor, negatives: int = 2048):
        self.answers = sorted({t for r in rows for t in r["response_ids"]})
        seen = set(self.answers)
        self.others = [t for t in range(lm_head.shape[0]) if t not in seen]
        self.lm_head, self.negatives = lm_head, min(negatives, len(self.others))
        self.draw(None)

    def draw(self, rng) -> None:
        """Pick this step's vocabulary: every answer token plus `negatives` others (none with rng=None)."""
        extra = rng.sample(self.others, self.negatives) if rng is not None else []
        self.ids = torch.tensor(sorted(self.answers + extra), dtype=torch.long)
        self.head = self.lm_head[self.ids].contiguous()
        self.index = torch.full((self.lm_head.shape[0],), -100, dtype=torch.long)
        self.index[self.ids] = torch.arange(len(self.ids))

    def __len__(self) -> int:
        return len(self.ids)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary labels (-100 = ignore) -> positions in this step's vocabulary."""
        return torch.where(labels >= 0, self.index[labels.clamp_min(0)], -100)


def block_mask(anchors: torch.Tensor, context_len: int, block: int) -> torch.Tensor:
    """[n*B, S + n*B] bool: context strictly before the block's anchor, plus the block itself."""
    n = anchors.shape[0]
    owner = torch.arange(n).repeat_interleave(block)
    sees_context = torch.arange(context_len)[None, :] < anchors[owner][:, None]
    sees_block = owner[:, None] == owner[None, :]
    return torch.cat([sees_context, sees_block], 1)
