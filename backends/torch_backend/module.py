"""The DFlash draft's weights as a torch nn.Module: its tensors as parameters under the checkpoint's own
(z-lab) names, so that training gets parameters(), state_dict() (the saved checkpoint), load_state_dict(),
.to() and torch's optimisers from torch instead of re-implementing them. Its forward is DFlashDraft.denoise
(draft.py: the one draft definition, used by inference too) over the current parameters, differentiably.
The target's embedding and head are frozen buffers, never saved."""

from __future__ import annotations

import torch
from torch import nn

from hetero_sd.models.config import DraftConfig

from .draft import DFlashDraft
from .layers import Rope


class DraftModule(nn.Module):
    def __init__(self, cfg: DraftConfig, tensors: dict[str, torch.Tensor], embed: torch.Tensor,
                 lm_head: torch.Tensor):
        """tensors: the draft's, by checkpoint name (float32 parameters, in this order); embed [V, H] and
        lm_head [V, H]: the target's, frozen (the module lives on their device)."""
        super().__init__()
        self.cfg = cfg
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        for name, t in tensors.items():
            self.place(name, nn.Parameter(t.detach().float().to(embed.device).clone()))
        self.rope = Rope(cfg.arch, embed.device, torch.float32)  # RoPE tables, grown on demand (not weights)

    def place(self, dotted: str, parameter: nn.Parameter) -> None:
        """'layers.0.self_attn.q_proj.weight' -> submodules layers / 0 / self_attn / q_proj, parameter weight."""
        *path, leaf = dotted.split(".")
        owner: nn.Module = self
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        owner.register_parameter(leaf, parameter)

    def draft(self, feature_size: int) -> DFlashDraft:
        """The draft module over the current parameters (unpacked, so gradients reach them)."""
        return DFlashDraft(self.cfg, dict(self.named_parameters()), "training", str(self.embed.device), torch.float32,
                           self.embed, self.lm_head.t(), feature_size, pack=False)

    def forward(self, features: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """DFlashDraft.denoise: blocks on a context, many at once; the final hidden states [R, H]."""
        return self.draft(features.shape[-1]).denoise(features, block_ids, positions, mask, self.rope)
