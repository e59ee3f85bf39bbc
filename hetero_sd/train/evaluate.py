"""Held-out evaluation that predicts decoding: simulated greedy decoding along the target's own answers.

At T=0 the target's continuation of a held-out prompt is the stored answer itself, so decoding can be
replayed without running the target: the first block is anchored at the first answer token (the prefill's
output), a block accepts its leading draft tokens that equal the answer's, and the next block is anchored
one past them (the target's bonus token). tau = mean accepted + 1 per block, exactly what the runtime
reports, with the runtime's own draft (`load_draft`: the inference path, int8 head as loaded by default)
and context features from the target's forward over the answer. Unlike the trainer's teacher-forced tau
(anchors every B tokens), it visits the positions decoding visits.

The floor every draft must clear: a 1-3-gram backoff table counted on the training answers, drafting each
block greedily from the last two tokens (no target features at all)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import torch

from hetero_sd.backends.torch_backend import load_draft
from hetero_sd.decoding.lookup import ContextLookup, CorpusTable
from hetero_sd.decoding.sampling import argmax_rows
from hetero_sd.models.config import DraftConfig


class NGramDraft:
    """Greedy 1-3-gram backoff: the most frequent successor of the last two tokens, else of the last one,
    else the most frequent token."""

    def __init__(self, rows: list[dict]):
        tri, bi, uni = defaultdict(Counter), defaultdict(Counter), Counter()
        for r in rows:
            ids = r["prompt_ids"][-2:] + r["response_ids"]
            start = len(ids) - len(r["response_ids"])
            for i in range(start, len(ids)):
                uni[ids[i]] += 1
                bi[ids[i - 1]][ids[i]] += 1
                if i >= 2:
                    tri[(ids[i - 2], ids[i - 1])][ids[i]] += 1
        self.tri = {k: c.most_common(1)[0][0] for k, c in tri.items()}
        self.bi = {k: c.most_common(1)[0][0] for k, c in bi.items()}
        self.top = uni.most_common(1)[0][0]

    def propose(self, history: list[int], count: int) -> list[int]:
        h, out = list(history[-2:]), []
        for _ in range(count):
            t = self.tri.get(tuple(h[-2:])) if len(h) >= 2 else None
            t = t if t is not None else self.bi.get(h[-1], self.top)
            out.append(t)
            h.append(t)
        return out


def replay(ids: list[int], start: int, block: int, guess, max_tokens: int) -> list[int]:
    """Accepted+1 per block when decoding the answer ids[start:] (start: the first answer token, which the
    prefill gives) up to `max_tokens` answer tokens; guess(anchor) -> the draft's B-1 tokens after it."""
    lengths, a, end = [], start, min(len(ids), start + max_tokens)
    while a < end - 1:
        want = ids[a + 1:min(a + block, end)]
        got = guess(a)[:len(want)]
        right = 0
        while right < len(want) and got[right] == want[right]:
            right += 1
        step = min(right + 1, end - 1 - a)  # the bonus token past the answer's end is not a token of it
        lengths.append(step)
        a += step
    return lengths


def summarise(per_row: list[tuple[str, list[int]]]) -> dict:
    out = {}
    for source in sorted({s for s, _ in per_row}) + ["all"]:
        blocks = [n for s, ls in per_row if source in ("all", s) for n in ls]
        rows = sum(1 for s, _ in per_row if source in ("all", s))
        out[source] = {"rows": rows, "blocks": len(blocks), "tau": round(sum(blocks) / max(len(blocks), 1), 4),
                       "position_1_right": round(sum(n > 1 for n in blocks) / max(len(blocks), 1), 4)}
    return out


def ngram_tau(table: NGramDraft, rows: list[dict], block: int, max_tokens: int) -> dict:
    per_row = []
    for r in rows:
        ids, p = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])
        per_row.append((r.get("source", "all"), replay(ids, p, block, lambda a: table.propose(ids[:a + 1], block - 1),
                                                       max_tokens)))
    return summarise(per_row)


@torch.no_grad()
def anchor_blocks(draft, features, rows: list[dict], max_tokens: int, size: int):
    """Every anchor of each row's first `max_tokens` answer tokens with the draft's block there (the draft fed
    the row's context features up to the anchor): yields (row, its ids, the anchor's index, the block's logits).
    For probes that read the draft's distributions at every position, not along a replay."""
    for r in rows:
        ids, p = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])
        feats = features(r["index"], ids, r.get("key"))
        draft.crop(0)
        for a in range(p, min(len(ids), p + max_tokens) - 1):
            if draft.context_length < a:
                draft.add_context(feats[draft.context_length:a])
            logits = draft.propose(ids[a], size=size)
            yield r, ids, a, getattr(logits, "logits", logits)


@torch.no_grad()
def draft_tau(folder: Path, features, rows: list[dict], max_tokens: int, block: int | None = None,
              lookup: float = 0.0) -> dict:
    """Simulated decoding with the draft in `folder` as the runtime loads it, at its own block size or
    `block`; `features` is the trainer's FeatureCache (its target and, with a disk store, the stored features).
    A smaller `block` is drafted as the block-size controller drafts it (propose(size=block)); a larger one
    makes the draft's blocks that long. lookup: the context lookup's weight in the proposals, as the runtime
    mixes it in at T=0 (decoding/lookup.py; 0: the draft's tokens alone)."""
    cfg = DraftConfig.from_folder(Path(folder))
    block = block or cfg.block_size
    cfg.block_size = max(block, cfg.block_size)
    draft = load_draft(Path(folder), cfg, features.target, "cpu", torch.float32, cfg.mask_token_id)
    corpus = CorpusTable.beside(folder) if lookup else None
    per_row = []
    for r in rows:
        ids, p = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])
        feats = features(r["index"], ids, r.get("key"))
        draft.crop(0)
        seen, fed = (ContextLookup(ids[:p], lookup, corpus=corpus) if lookup else None), [p]  # it has ids[:fed[0]]

        def guess(a: int) -> list[int]:
            if draft.context_length < a:
                draft.add_context(feats[draft.context_length:a])
            logits = draft.propose(ids[a], size=block)
            logits = getattr(logits, "logits", logits)
            if seen is None:
                return logits.argmax(-1).tolist()
            seen.extend(ids[fed[0]:a + 1])
            fed[0] = a + 1
            return seen.steer(logits, argmax_rows(logits))

        per_row.append((r.get("source", "all"), replay(ids, p, block, guess, max_tokens)))
    return summarise(per_row)
