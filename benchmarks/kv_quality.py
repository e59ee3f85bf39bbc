"""Issue 26: what the int8 target's K/V cache kinds do to its predictions. On the bench's chat and HumanEval
prompts, the float16-cache target (llama.cpp's default) answers greedily; then every kind in --kinds reads prompt +
answer in one forward (teacher-forced) and its next-token distributions at the answer's positions are compared
with those of the float32 K/V cache (the most exact kind): how often the top token differs, the mean and largest
KL divergence, the largest logit difference. Lossless decoding is not the question (each kind's DFlash equals
its own plain decoding, tested); this is how much each cache moves the model itself.

    python benchmarks/kv_quality.py --kinds float16,q8_0 --limit 12 --tokens 128 --json benchmarks/results/kq8_zen5/kv_quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import hetero_sd
from hetero_sd.cli.policy import policy_from_env
from hetero_sd.prompts import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402

POLICIES = {kind: policy_from_env({"HETERO_SD_KV": kind}) for kind in ("float32", "float16", "q8_0")}  # as HETERO_SD_KV names them


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="float16,q8_0")
    ap.add_argument("--limit", type=int, default=12, help="prompts per dataset")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(POLICIES) - {"float32"}:
        raise SystemExit("--kinds: float16 and/or q8_0 (each is compared with the float32 cache)")
    rts = {k: hetero_sd.load("default", None, dtype="int8", policy=POLICIES[k]) for k in ["float32"] + kinds}
    for name, rt in rts.items():
        if name == "q8_0" and rt.target.cache.k[0].dtype != torch.uint8:
            raise SystemExit("no q8_0 K cache here (it needs AVX512-VNNI): " + "; ".join(rt.notes))
    answerer = rts.get("float16") or hetero_sd.load("default", None, dtype="int8", policy=POLICIES["float16"])
    per = {k: {"positions": 0, "top1_differs": 0, "kl_sum": 0.0, "kl_max": 0.0, "logit_max": 0.0} for k in kinds}
    for dataset in ("chat", "humaneval"):
        for p in load_prompts(dataset=dataset)[:args.limit]:
            ids, _ = answerer.encode(p.text)
            answer = answerer.generate(ids, max_new_tokens=args.tokens, temperature=0.0, speculative=False).token_ids
            logits = {}
            for name, rt in rts.items():
                t = rt.target.fork()
                t.crop(0)
                logits[name] = t.forward(ids + answer, features=False).logits[len(ids) - 1:-1].double()
            ref = logits["float32"].log_softmax(-1)
            for k in kinds:
                mine = logits[k].log_softmax(-1)
                kl = (ref.exp() * (ref - mine)).sum(-1)
                s = per[k]
                s["positions"] += len(answer)
                s["top1_differs"] += int((logits[k].argmax(-1) != logits["float32"].argmax(-1)).sum())
                s["kl_sum"] += float(kl.sum())
                s["kl_max"] = max(s["kl_max"], float(kl.max()))
                s["logit_max"] = max(s["logit_max"], float((logits[k] - logits["float32"]).abs().max()))
            print(f"{dataset} {p.text[:50]!r}: " + ", ".join(
                f"{k} top-1 differs {per[k]['top1_differs']}/{per[k]['positions']}" for k in kinds), flush=True)
    summary = {k: {"positions": s["positions"], "top1_differs": s["top1_differs"],
                   "top1_differs_rate": round(s["top1_differs"] / s["positions"], 5),
                   "mean_kl_nats": round(s["kl_sum"] / s["positions"], 8), "max_kl_nats": round(s["kl_max"], 6),
                   "max_logit_difference": round(s["logit_max"], 4)} for k, s in per.items()}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "what": "int8 default target: each K/V cache kind's teacher-forced next-token distributions against the "
                    "float32 K/V cache's, on the float16-cache target's own greedy answers",
            "command": " ".join(["python"] + sys.argv), "lscpu": lscpu(), "tokens": args.tokens,
            "prompts_per_dataset": args.limit, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
