"""Time to first token at the fifth turn of a conversation, without and with the prefix cache (Runtime.prefix_cache,
on in `hetero-sd serve`). The conversation is built once (T=0 answers); then, for each repeat and each
setting, the first four turns are replayed (with the cache on they leave their caches behind) and the fifth is timed.
Writes JSON with each run's TTFT, the medians, the prompt length and the tokens reused.

    python benchmarks/prefix_cache_ttft.py --json benchmarks/results/serving/prefix_cache_ttft.json"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import hetero_sd

QUESTIONS = ["Tell me about the history of Rome in a few sentences.", "What about its architecture?",
             "Which emperors are the best known, and why?", "How did the empire end?",
             "Summarise everything we discussed in three bullet points."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/serving/prefix_cache_ttft.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    rt = hetero_sd.load(args.target, args.draft)
    messages, answers = [], []
    for q in QUESTIONS[:4]:  # the conversation, built once
        messages.append({"role": "user", "content": q})
        g = rt.generate(messages, max_new_tokens=args.max_new_tokens)
        answers.append(g.text)
        messages.append({"role": "assistant", "content": g.text})
    turns = [messages[:2 * i + 1] for i in range(4)]
    last = messages + [{"role": "user", "content": QUESTIONS[4]}]
    runs = {"without": [], "with": []}
    for _ in range(args.repeats):
        for setting in ("without", "with"):
            rt.prefix_cache = setting == "with"
            for t in turns:
                rt.generate(t, max_new_tokens=args.max_new_tokens)
            g = rt.generate(last, max_new_tokens=8)
            runs[setting].append({"ttft_s": g.stats.ttft_s, "prompt_tokens": g.stats.num_prompt_tokens,
                                  "cached_tokens": g.stats.num_cached_tokens, "prefill_s": g.stats.prefill_s})
            rt.prefix_cache = False
    med = {k: statistics.median(r["ttft_s"] for r in v) for k, v in runs.items()}
    doc = {"turn": 5, "prompt_tokens": runs["with"][0]["prompt_tokens"],
           "cached_tokens": [r["cached_tokens"] for r in runs["with"]],
           "ttft_median_s": med, "speedup": med["without"] / med["with"] if med["with"] else None, "runs": runs,
           "models": {"target": rt.info.get("target"), "draft": rt.info.get("draft")},
           "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None,
           "cores": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "note": args.note}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: doc[k] for k in ("prompt_tokens", "cached_tokens", "ttft_median_s", "speedup")}, indent=2))
    rt.close()


if __name__ == "__main__":
    main()
