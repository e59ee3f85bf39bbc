"""How far the int8 target (`--dtype int8`) is from the float32 one (the default), on the bench's chat
and HumanEval prompts: greedy tokens until the first difference, tokens equal out of N, and the largest
logit difference on the float32 target's own continuation (teacher-forced, decode and verify rows).
Lossless decoding is not the question here (each target's DFlash equals its own plain decoding, tested);
this is whether int8 is the same model, which decides that it is not the default.

    python benchmarks/int8_quality.py --limit 6 --max-new-tokens 64 --json benchmarks/results/int8_quality.json
"""

from __future__ import annotations

import argparse
import json

import torch

from hetero_sd.bench.runner import machine
from hetero_sd.prompts import load_prompts
from hetero_sd.runtime import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    f32, i8 = load("default", None), load("default", None, dtype="int8")
    rows = []
    for dataset in ("chat", "humaneval"):
        for prompt in (p.text for p in load_prompts(dataset=dataset, limit=args.limit)):
            a = f32.generate(prompt, max_new_tokens=args.max_new_tokens)
            b = i8.generate(prompt, max_new_tokens=args.max_new_tokens)
            same = sum(x == y for x, y in zip(a.token_ids, b.token_ids))
            first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            ids = a.prompt_ids + a.token_ids
            diffs = []
            for rt in (f32, i8):  # the float32 continuation through both targets: prefill, then 8-row verifies
                t = rt.target.fork()
                t.forward(a.prompt_ids, features=False)
                diffs.append(torch.cat([t.forward(ids[i:i + 8], features=False).logits
                                        for i in range(len(a.prompt_ids), len(ids), 8)]))
            n = min(len(d) for d in diffs)
            gap = (diffs[0][:n] - diffs[1][:n]).abs().amax(-1)
            rows.append({"dataset": dataset, "tokens": len(a.token_ids), "equal_tokens": same,
                         "first_difference": first, "max_logit_diff": round(gap.max().item(), 4),
                         "median_logit_diff": round(gap.median().item(), 4),
                         "argmax_agreement": round((diffs[0][:n].argmax(-1) == diffs[1][:n].argmax(-1)).float().mean().item(), 4)})
            print(rows[-1])
    out = {"machine": machine(), "command": "python benchmarks/int8_quality.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()), "float32": f32.info["target_weights"],
        "int8": i8.info["target_weights"], "prompts": rows,
        "summary": {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in ("max_logit_diff", "argmax_agreement")}
        | {"generations_identical": sum(r["first_difference"] is None for r in rows), "of": len(rows)}}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(out["summary"])


if __name__ == "__main__":
    main()
