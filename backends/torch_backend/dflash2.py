"""The pieces DFlash2 adds to a DFlash draft, in torch.

- Grouped dynamic causal convolution, around attention and around the MLP of every layer. Over the
  block's positions only (the context reaches the block through attention): for kernel size K,
  y[t] = sum_{o<K} (base[o] + d[t, o, g]) * x[t - o] (zero before the anchor), where base is a kernel
  per channel and d a scalar per group of channels, projected from the layer's normed input at t.
  `prepare` convolves the input of the sublayer; `finish` convolves its output with the second kernel,
  whose dynamic part was projected from the same normed input.
- Candidate selector: the top-k of each position's logits, rescored as
  logit(c) + <pred[previous] * P h_i, succ[c]> (low-rank codebooks over the vocabulary, P a projection
  of the draft's final hidden state), walked in order; see backends/selection.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero_sd.models.config import DraftConfig
from hetero_sd.errors import ConfigError
from hetero_sd.backends.base import SelectorBlock
from hetero_sd.models.weights import take

from .layers import DecoderLayer, linear, rms_norm


def convolve(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """x [b, T, H], dynamic [b, T, K, G], base [K, H] -> [b, T, H]."""
    b, t, h = x.shape
    groups = h // group
    blocks = x.view(b, t, groups, group)
    dynamic = dynamic.unsqueeze(-1)
    out = torch.zeros_like(blocks)
    for o in range(base.shape[0]):
        shifted = blocks if o == 0 else F.pad(blocks[:, :-o], (0, 0, 0, 0, o, 0))  # x[t - o], 0 before the block
        out = out + base[o].view(1, 1, groups, group) * shifted
        out = torch.addcmul(out, dynamic[:, :, o], shifted)
    return out.view_as(x)


class DynamicConv(nn.Module):
    """One sublayer's convolution pair (its two base kernels and the projection of their dynamic parts),
    the weights as registered buffers."""

    def __init__(self, tensors: dict, prefix: str, cfg: DraftConfig, where, device, dtype):
        super().__init__()
        fmt, h = cfg.format, cfg.arch.hidden_size
        self.kernel, self.group = fmt.conv_kernel_size, fmt.conv_group_size
        groups = h // self.group
        base = take(tensors, prefix + "base_kernel", (2, self.kernel, h), where)
        self.register_buffer("base", base.to(device, dtype))
        proj = take(tensors, prefix + "kernel_projection.weight", (2 * self.kernel * groups, h), where)
        self.register_buffer("projection", proj.to(device, dtype).t().contiguous())

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = linear(x, self.projection).view(*x.shape[:-1], 2, self.kernel, -1)
        return convolve(x, dynamic[..., 0, :, :], self.base[0], self.group), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return convolve(x, dynamic, self.base[1], self.group)


def layer_convs(tensors: dict, cfg: DraftConfig, where, device, dtype) -> nn.ModuleList:
    """Per layer, (the attention's convolution, the MLP's): a ModuleList of pairs."""
    return nn.ModuleList(nn.ModuleList([DynamicConv(tensors, f"layers.{i}.attention_conv.", cfg, where, device, dtype),
                                        DynamicConv(tensors, f"layers.{i}.mlp_conv.", cfg, where, device, dtype)])
                         for i in range(cfg.arch.num_hidden_layers))


def conv_layer(layer: DecoderLayer, convs, h: torch.Tensor, cos, sin, write, mask):
    """One DFlash2 layer: the DFlash layer with each sublayer wrapped in its convolution.
    `write(k, v)` stores the block's K/V after the context and returns all keys and values."""
    attention_conv, mlp_conv = convs
    x, kernel = attention_conv.prepare(rms_norm(h, layer.in_norm, layer.cfg.rms_norm_eps))
    q, k, v = layer.project_qkv(x, cos, sin)
    keys, values = write(k, v)
    h = h + attention_conv.finish(layer.attention(q, keys, values, mask), kernel)
    x, kernel = mlp_conv.prepare(rms_norm(h, layer.post_norm, layer.cfg.rms_norm_eps))
    return h + mlp_conv.finish(layer.mlp(x), kernel)


class Selector(nn.Module):
    """The candidate selector's codebooks and projection, as registered buffers."""

    def __init__(self, tensors: dict, cfg: DraftConfig, where, device, dtype):
        super().__init__()
        fmt, arch = cfg.format, cfg.arch
        if not 0 < fmt.selector_top_k <= arch.vocab_size:
            raise ConfigError(f"{where}: selector_top_k {fmt.selector_top_k} is not within the vocabulary "
                              f"(1..{arch.vocab_size})", "re-download the draft")
        self.top_k, rank = fmt.selector_top_k, fmt.selector_rank
        p = "candidate_selector."
        for name, key, shape in (("predecessor", "predecessor_codebook", (arch.vocab_size, rank)),
                                 ("successor", "successor_codebook", (arch.vocab_size, rank))):
            self.register_buffer(name, take(tensors, p + key + ".weight", shape, where).to(device, dtype))
        projection = take(tensors, p + "hidden_projection.weight", (rank, arch.hidden_size), where)
        self.register_buffer("projection", projection.to(device, dtype).t().contiguous())

    def block(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int) -> SelectorBlock:
        """hidden [n, H] (the draft's final normed states), logits [n, vocab] -> the block, walked on demand."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = linear(hidden, self.projection)  # [n, rank]
        successors = F.embedding(candidates, self.successor)  # [n, k, rank]

        @torch.inference_mode()
        def walk(temperature: float, generator: torch.Generator | None):
            previous, tokens, rows = anchor, [], []
            for i in range(candidates.shape[0]):
                scores = unary[i] + successors[i] @ (self.predecessor[previous] * projected[i])
                if temperature > 0:
                    q = (scores.float() / temperature).softmax(-1)
                    index = torch.multinomial(q, 1, generator=generator).item()
                    rows.append(q)
                else:
                    index = scores.argmax().item()
                previous = int(candidates[i, index])
                tokens.append(previous)
            return tokens, candidates, torch.stack(rows) if rows else None

        return SelectorBlock(logits, walk)
