"""Would gating speculation on confidence make the default draft pay? Measured acceptance, modelled speed.

Decodes the prompts plainly with the default target (greedy) and, at every position, also drafts a block of
8 from that anchor: it records the target's probability of the anchor (free at decision time), the draft's
probability of each drafted token, and whether each drafted token is the target's; and position 1 of the
blocks of 2 and 4 that the block-size controller drafts from the same anchor (fewer mask rows). Then:
- acceptance of position 1 by bucket of each signal (does it predict acceptance?);
- a gating policy replayed on those records: draft the block of 8, verify only the leading drafted tokens
  (at most `size` - 1) whose running product of draft probabilities stays >= tau, decode plainly when none
  does. Its tokens per decode step come from the measured step costs of `bench --costs` (--costs JSON):
  modelled, not timed. The draft of 8 runs on every step (its confidence is what gates), so its cost is paid
  on plain steps too.

    python benchmarks/confidence_gate.py --limit 12 --max-new-tokens 128 \
        --costs benchmarks/results/costs_default_stack_avx2.json --json benchmarks/results/confidence_gate.json"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetero_sd  # noqa: E402
from hetero_sd.backends.base import logits_of  # noqa: E402
from hetero_sd.bench.runner import machine  # noqa: E402
from hetero_sd.prompts import load_prompts  # noqa: E402

BLOCK = 8
Q_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)
P_EDGES = (0.0, 0.5, 0.8, 0.95, 0.99, 1.01)


@torch.inference_mode()
def record(rt, text: str, max_new: int) -> list[dict]:
    """One prompt decoded plainly; per position the anchor's target probability and the draft's block."""
    target, draft = rt.target, rt.draft
    target.crop(0)
    draft.crop(0)
    ids, _ = rt.encode(text)
    out = target.forward(ids, last_only=True)
    draft.add_context(out.features)
    probs, rows = out.logits[-1].softmax(-1), []
    for _ in range(max_new):
        p_anchor, anchor = (float(v) for v in probs.max(-1))
        anchor = int(anchor)
        if anchor in rt.stop_ids:
            break
        q, drafted = logits_of(draft.propose(anchor, size=BLOCK)).softmax(-1).max(-1)
        short = {size: int(logits_of(draft.propose(anchor, size=size))[0].argmax()) for size in (2, 4)}
        out = target.forward([anchor])
        draft.add_context(out.features)
        probs = out.logits[-1].softmax(-1)
        rows.append({"p_anchor": p_anchor, "q": [round(float(v), 4) for v in q], "drafted": drafted.tolist(),
                     "next": int(probs.argmax()), "short": short})
    return rows


def buckets(rows: list[dict], value, edges) -> list[dict]:
    out = []
    for lo, hi in zip(edges, edges[1:]):
        hit = [r for r in rows if lo <= value(r) < hi]
        if hit:
            out.append({"from": lo, "to": min(hi, 1.0), "share": round(len(hit) / len(rows), 3),
                        "position_1_accepted": round(sum(r["drafted"][0] == r["next"] for r in hit) / len(hit), 3)})
    return out


def gated(seqs: list[list[dict]], costs: dict, size: int, tau: float) -> float:
    """Tokens per decode step of the policy (module docstring) replayed on the recorded positions."""
    decode = costs["decode_s"]
    verify = {int(k): v / decode for k, v in costs["verify_s"].items()}
    draft = costs["draft_s"][str(BLOCK)] / decode  # the block of 8 whose confidences gate

    def verify_cost(n: int) -> float:
        if n in verify:
            return verify[n]
        lo, hi = max(k for k in verify if k < n), min(k for k in verify if k > n)
        return verify[lo] + (verify[hi] - verify[lo]) * (n - lo) / (hi - lo)

    tokens = cost = 0.0
    for seq in seqs:
        i = 0
        while i < len(seq):
            r, k, chain = seq[i], 0, 1.0
            for q in r["q"][:size - 1]:
                chain *= q
                if chain < tau:
                    break
                k += 1
            if k == 0:
                cost, tokens, i = cost + 1 + draft, tokens + 1, i + 1
                continue
            a = 0
            while a < k and i + a < len(seq) and r["drafted"][a] == seq[i + a]["next"]:
                a += 1
            cost, tokens, i = cost + verify_cost(k + 1) + draft, tokens + a + 1, i + a + 1
    return tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="default", help="draft folder or shipped name")
    ap.add_argument("--datasets", default="chat,humaneval")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--costs", default=str(ROOT / "benchmarks/results/costs_default_stack_avx2.json"),
                    help="a `hetero-sd bench --costs --json` result measured on this machine")
    ap.add_argument("--json")
    args = ap.parse_args()
    costs = json.loads(Path(args.costs).read_text())["costs"]
    rt = hetero_sd.load("default", args.draft, block_size=BLOCK)
    began = time.time()
    result = {"command": " ".join(["python"] + sys.argv), "machine": machine(), "draft": rt.info.get("draft"),
              "costs_from": args.costs,
              "note": "acceptance measured; tokens per decode step modelled from the measured step costs", "sets": {}}
    for name in args.datasets.split(","):
        seqs = [record(rt, p.text, args.max_new_tokens) for p in load_prompts(None, name, args.limit)]
        rows = [r for s in seqs for r in s]
        policies = {f"block {size}, tau {tau}": round(gated(seqs, costs, size, tau), 3)
                    for size in (2, 4, 8) for tau in (0.0, 0.5, 0.7, 0.9)}
        best = max(policies, key=policies.get)
        result["sets"][name] = {
            "prompts": len(seqs), "positions": len(rows),
            "position_1_accepted": round(sum(r["drafted"][0] == r["next"] for r in rows) / len(rows), 3),
            "position_1_accepted_by_block_size": {
                **{size: round(sum(r["short"][size] == r["next"] for r in rows) / len(rows), 3) for size in (2, 4)},
                BLOCK: round(sum(r["drafted"][0] == r["next"] for r in rows) / len(rows), 3)},
            "by_draft_probability": buckets(rows, lambda r: r["q"][0], Q_EDGES),
            "by_target_anchor_probability": buckets(rows, lambda r: r["p_anchor"], P_EDGES),
            "tokens_per_decode_step": policies, "best": {best: policies[best]}}
        print(name, json.dumps(result["sets"][name], indent=1), flush=True)
    result["seconds"] = round(time.time() - began, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
