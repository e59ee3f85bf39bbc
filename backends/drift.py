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

NO_BLOCK = "no draft block ran (the controller decoded plainly): no drift to report"


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
        """The figures; where no draft block was compared they are None and `note` says so (a mean over
        nothing is not a measurement)."""
        head = {"device": self.device, "reference": "float32 draft on the CPU", "blocks": self.blocks,
                "nonfinite_blocks": self.nonfinite_blocks}
        if not self.positions:
            return head | {"top1_agreement": None, "kl": None, "cosine": None, "cosine_min": None,
                           "note": NO_BLOCK if not self.blocks else "every compared block was non-finite"}
        n = self.positions
        return head | {"top1_agreement": self.agree / n, "kl": self.kl_sum / n, "cosine": self.cosine_sum / n,
                       "cosine_min": self.cosine_min}

    def summary(self) -> str:
        """One line for people: the figures, or why there are none."""
        d = self.to_dict()
        if d["cosine"] is None:
            return f"{self.device}: {d['note']}"
        return (f"{self.device} over {self.blocks} blocks: cosine {d['cosine']:.5f} (min {d['cosine_min']:.5f}), "
                f"top-1 agreement {d['top1_agreement']:.3f}, KL {d['kl']:.2e}")
