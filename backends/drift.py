"""Precision drift of a draft device against the float32 reference draft on the same context.

`backends.shadow.ShadowedDraft` wraps the device's draft and the reference: both receive the same
context; each block (every `every`-th one) is drafted by both and compared here. Figures, per block position:
- top1_agreement: the two proposals are the same token;
- kl: KL(reference || device) of the two softmax distributions, in nats;
- cosine: cosine similarity of the final normed hidden states;
and, measured by `bench` on the same prompts, tau_ratio = tau(device) / tau(reference).
Only the device's proposals are used for decoding, so the output is unaffected."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F



@dataclass
class Drift:
    device: str = ""
    blocks: int = 0
    positions: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    cosine_sum: float = 0.0
    cosine_min: float = 1.0
    nonfinite_blocks: int = 0

    def add(self, reference: torch.Tensor, device: torch.Tensor, ref_hidden, dev_hidden) -> None:
        self.blocks += 1
        if not torch.isfinite(device).all():
            self.nonfinite_blocks += 1
            return
        self.positions += reference.shape[0]
        self.agree += int((reference.argmax(-1) == device.argmax(-1)).sum())
        logp, logq = reference.float().log_softmax(-1), device.float().log_softmax(-1)
        self.kl_sum += float((logp.exp() * (logp - logq)).sum())
        if ref_hidden is not None and dev_hidden is not None:
            cos = F.cosine_similarity(ref_hidden.float(), dev_hidden.float(), dim=-1)
            self.cosine_sum += float(cos.sum())
            self.cosine_min = min(self.cosine_min, float(cos.min()))

    @classmethod
    def total(cls, meters: list["Drift"]) -> "Drift":
        out = cls(meters[0].device if meters else "")
        for m in meters:
            out.blocks += m.blocks
            out.positions += m.positions
            out.agree += m.agree
            out.kl_sum += m.kl_sum
            out.cosine_sum += m.cosine_sum
            out.cosine_min = min(out.cosine_min, m.cosine_min)
            out.nonfinite_blocks += m.nonfinite_blocks
        return out

    def to_dict(self) -> dict:
        n = max(self.positions, 1)
        return {"device": self.device, "reference": "float32 draft on the CPU", "blocks": self.blocks,
                "top1_agreement": self.agree / n, "kl": self.kl_sum / n, "cosine": self.cosine_sum / n,
                "cosine_min": self.cosine_min, "nonfinite_blocks": self.nonfinite_blocks}
