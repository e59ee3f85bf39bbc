"""What training adds to the torch backend's draft module (backends/torch_backend/module.py: DraftModule,
an nn.Module whose parameters are the draft's tensors under their z-lab names, so parameters(),
state_dict() (the saved checkpoint), load_state_dict() and the optimiser are torch's own; its forward is
the one draft definition used for inference too): every block of a sequence in one forward
(`block_mask`), and the reduced vocabulary of the loss (`TrainingVocab`). The target's embedding and
lm_head are used frozen and never saved.

Training puts every block of a sequence into one forward: block j, anchored at position a_j, attends to
the context features strictly before a_j and to its own block (bidirectionally), never to other blocks.
With one block this is exactly the inference forward (TorchDraft.denoise against TorchDraft.propose)."""

from __future__ import annotations

import torch

from hetero_sd.backends.torch_backend import DraftModule
from hetero_sd.models.config import DraftConfig
from hetero_sd.models.draft_init import random_draft_tensors


class TrainingDraft(DraftModule):
    """The draft under training: a DraftModule started from HF's Qwen3 initialisation (train() then starts
    it from the target's layers or an earlier draft), whose forward takes a sequence and its anchors."""

    def __init__(self, raw: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        """raw: the draft's config.json (dict); embed [V, H] and lm_head [V, H]: the target's, frozen; the
        draft trains on their device."""
        initial = random_draft_tensors(raw)
        order = [n for n in initial if n != "norm.weight"] + ["norm.weight"]  # the checkpoint's order
        super().__init__(DraftConfig.from_dict(raw), {n: initial[n] for n in order}, embed, lm_head)
        self.raw, self.block_size, self.mask_token_id = raw, self.cfg.block_size, self.cfg.mask_token_id

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                starts: torch.Tensor | None = None) -> torch.Tensor:
        """features [S, L*H], tokens [S], anchors [n] (positions): hidden [n, B-1, H] for block positions
        1..B-1 (what the lm_head turns into draft logits). Several sequences packed end to end train in
        one forward: `starts` [n] gives the first position of each anchor's sequence, and a block sees
        only its own sequence's context (RoPE is relative, so the offset changes nothing)."""
        b, n, device = self.block_size, anchors.shape[0], self.device
        tokens, anchors = tokens.to(device), anchors.to(device)
        starts = torch.zeros_like(anchors) if starts is None else starts.to(device)
        block_ids = torch.full((n, b), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = tokens[anchors]
        positions = (anchors[:, None] + torch.arange(b, device=device)).flatten()
        hidden = super().forward(features, block_ids.flatten(), positions,
                                 block_mask(anchors, features.shape[0], b, starts))
        return hidden.view(n, b, -1)[:, 1:]

    def logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> [..., V]; flattened to one 2-D matmul (a 3-D one runs as a slow bmm here).
        `head` replaces the full lm_head, e.g. by its rows for the training vocabulary."""
        head = self.lm_head if head is None else head
        flat = hidden.reshape(-1, hidden.shape[-1]) @ head.t()
        return flat.view(*hidden.shape[:-1], -1)


class TrainingVocab:
    """The loss's softmax over the tokens the labels can take (the target's own answers) plus a fresh
    random sample of the other tokens each step, not over all V.

    On this CPU the lm_head's forward and backward over 49k tokens cost ~70% of a step; SmolLM2's answers
    use ~8k distinct tokens, so a step gets ~3x cheaper (EAGLE-3 trains over a reduced draft vocabulary for
    the same reason). The sampled others keep pushing every token down over the run: without them a token
    never seen in an answer is never penalised and can win the full-vocabulary argmax at inference.
    Inference and the held-out estimate use the full lm_head.

    `frequent=K`: only the K most frequent answer tokens are in every step's softmax, plus the tokens that
    are labels in this step (`draw(rng, labels)`) and the random negatives (drawn from all other tokens,
    rare answer tokens included). Every label is still scored against a softmax that contains it (a
    sampled softmax); with 11.7k answers the answers hold 24k distinct tokens, and K = 8192 covers 96% of
    answer tokens at a third of the head's cost."""

    def __init__(self, rows: list[dict], lm_head: torch.Tensor, negatives: int = 2048, frequent: int | None = None):
        from collections import Counter
        counts = Counter(t for r in rows for t in r["response_ids"])
        self.answers = sorted(counts) if frequent is None else sorted(t for t, _ in counts.most_common(frequent))
        seen = set(self.answers)
        self.others = [t for t in range(lm_head.shape[0]) if t not in seen]
        self.lm_head, self.negatives = lm_head, min(negatives, len(self.others))
        self.draw(None)

    def draw(self, rng, labels: torch.Tensor | None = None) -> None:
        """Pick this step's vocabulary: the (frequent) answer tokens, this step's `labels` (full-vocabulary
        ids, -100 ignored) and `negatives` others (none with rng=None)."""
        extra = rng.sample(self.others, self.negatives) if rng is not None else []
        if labels is not None:
            extra += labels[labels >= 0].unique().tolist()
        device = self.lm_head.device
        self.ids = torch.tensor(sorted(set(self.answers).union(extra)), dtype=torch.long, device=device)
        self.head = self.lm_head[self.ids].contiguous()
        self.index = torch.full((self.lm_head.shape[0],), -100, dtype=torch.long, device=device)
        self.index[self.ids] = torch.arange(len(self.ids), device=device)

    def __len__(self) -> int:
        return len(self.ids)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary labels (-100 = ignore) -> positions in this step's vocabulary."""
        return torch.where(labels >= 0, self.index[labels.clamp_min(0)], -100)


def block_mask(anchors: torch.Tensor, context_len: int, block: int, starts: torch.Tensor | None = None) -> torch.Tensor:
    """[n*B, S + n*B] bool: the context of the block's own sequence (from `starts`, default 0) strictly
    before its anchor, plus the block itself."""
    n, device = anchors.shape[0], anchors.device
    owner = torch.arange(n, device=device).repeat_interleave(block)
    context = torch.arange(context_len, device=device)[None, :]
    sees_context = context < anchors[owner][:, None]
    if starts is not None:
        sees_context &= context >= starts[owner][:, None]
    sees_block = owner[:, None] == owner[None, :]
    return torch.cat([sees_context, sees_block], 1)
