"""Issue 26, the default-numerics decision: end to end, the default target in float32 (today's default) vs
`--dtype int8` (llama.cpp's numerics), each with the shipped draft under the block-size controller and
autoregressively, in ONE process, interleaved prompt by prompt (the machine is shared). Measured in tokens per
CPU-second of this process (time.process_time) with one torch thread by default: on a loaded machine the
process's own CPU time is what other jobs disturb least; wall-clock tokens/s are recorded too.

    python benchmarks/int8_e2e.py [--threads 1] [--limit 6] [--tokens 64] [--rounds 2] --json out.json
--variants A,B compares other targets the same way (the second over the first): float32, int8 (the default),
int8-f16kv (its K/V cache float16), int8-q8k (its K cache as q8_0 blocks, llama.cpp's -ctk q8_0: the default where
the CPU has AVX512-VNNI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.prompts import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--load-note", default="say what else ran on the machine")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--datasets", default="chat,humaneval")
    ap.add_argument("--variants", default="float32,int8")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p for d in args.datasets.split(",") for p in load_prompts(dataset=d, limit=args.limit // 2)]
    known = {"float32": {"dtype": "float32"}, "int8": {"dtype": "int8"},
             "int8-f16kv": {"dtype": "int8", "policy": LoadPolicy(k_q8=False)},
             "int8-q8k": {"dtype": "int8", "policy": LoadPolicy(k_q8=True)}}
    names = args.variants.split(",")
    if len(names) != 2 or not set(names) <= set(known):
        raise SystemExit(f"--variants: two of {', '.join(known)}")
    rts = {d: hetero_sd.load("default", "default", cpu_threads=args.threads, **known[d]) for d in names}
    if "int8-q8k" in rts and rts["int8-q8k"].target.cache.k[0].dtype != torch.uint8:
        raise SystemExit("int8-q8k: no q8_0 K cache here: " + "; ".join(rts["int8-q8k"].notes))
    ids = [rts[names[0]].encode(p.text)[0] for p in prompts]
    for rt in rts.values():  # warm-up (kernels, costs)
        rt.generate(ids[0], max_new_tokens=8)
    modes = {"autoregressive": {"speculative": False}, "speculative (auto)": {}}
    acc = {(d, m): {"tokens": 0, "cpu_s": [], "wall_s": [], "tau": []} for d in rts for m in modes}
    for r in range(args.rounds):
        for i, prompt in enumerate(ids):
            for mode, kw in modes.items():
                for d, rt in rts.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    g = rt.generate(prompt, max_new_tokens=args.tokens, temperature=0.0, stop_at_eos=True, **kw)
                    c, w = time.process_time() - c0, time.perf_counter() - w0
                    a = acc[(d, mode)]
                    a["tokens"] += len(g.token_ids)
                    a["cpu_s"].append(c)
                    a["wall_s"].append(w)
                    if g.stats.mean_acceptance_length:
                        a["tau"].append(g.stats.mean_acceptance_length)
                    print(f"round {r} prompt {i} {mode:18s} {d:8s} {len(g.token_ids):3d} tok  cpu {c:6.2f} s  "
                          f"wall {w:6.2f} s", flush=True)
    table = {}
    for (d, mode), a in acc.items():
        table.setdefault(mode, {})[d] = {"tokens": a["tokens"], "tokens_per_cpu_s": round(a["tokens"] / sum(a["cpu_s"]), 2),
                                        "tokens_per_wall_s": round(a["tokens"] / sum(a["wall_s"]), 2),
                                        "tau": round(statistics.mean(a["tau"]), 3) if a["tau"] else None}
    a, b = names
    for mode, t in table.items():
        t[f"{b}_over_{a}_tokens_per_cpu_s"] = round(t[b]["tokens_per_cpu_s"] / t[a]["tokens_per_cpu_s"], 3)
        t[f"{b}_over_{a}_tokens_per_wall_s"] = round(t[b]["tokens_per_wall_s"] / t[a]["tokens_per_wall_s"], 3)
    doc = {"command": " ".join(["python"] + sys.argv), "lscpu": lscpu(), "threads": args.threads,
           "prompts": len(ids), "max_new_tokens": args.tokens, "rounds": args.rounds,
           "load_note": args.load_note,
           "table": table}
    print(json.dumps(table, indent=1))
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
