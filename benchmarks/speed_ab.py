"""Before/after of issue 12 in ONE process, interleaved (the machine is shared: only a same-process,
same-minute comparison means anything): the cost probe on the previous paths (torch matmul for float32,
float32 draft) and on the defaults (float32 decoding GEMM, bf16 draft where the CPU has native bf16),
`--rounds` alternations, medians. Writes {"before": costs, "after": costs, "rounds": [...]} where each
costs object is what `hetero-sd bench --costs --json` writes.

    python benchmarks/speed_ab.py --rounds 3 --json benchmarks/results/costs_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.bench.runner import machine
from hetero_sd.decoding.costs import Costs, measure_costs
from hetero_sd.runtime import load


def runtime(kernel: bool, draft_dtype: str | None, target_dtype: str | None):
    return load("default", "cpu-trained", dtype=target_dtype, draft_dtype=draft_dtype, policy=LoadPolicy(gemm=kernel))


def median_costs(runs: list[Costs]) -> Costs:
    first = runs[0]
    med = lambda f: statistics.median(f(c) for c in runs)  # noqa: E731
    out = Costs(decode_s=med(lambda c: c.decode_s),
                verify_s={k: med(lambda c, k=k: c.verify_s[k]) for k in first.verify_s},
                draft_s={b: med(lambda c, b=b: c.draft_s[b]) for b in first.draft_s},
                peak_gflops=first.peak_gflops, bandwidth_gbs=first.bandwidth_gbs, cpu=first.cpu, dtype=first.dtype,
                context=first.context, threads=first.threads, floors_s=first.floors_s, notes=first.notes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", required=True)
    ap.add_argument("--bf16-target", action="store_true", help="also the (different, opt-in) bf16 target")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = {"before": runtime(False, "float32", None), "after": runtime(True, None, None)}
    if args.bf16_target:
        variants["after, bf16 target"] = runtime(True, None, "bfloat16")
    runs = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, rt in variants.items():
            c = measure_costs(rt.target, rt.draft, machine=r == 0)
            runs[name].append(c)
            print(f"round {r} {name:20s} decode {c.decode_s * 1e3:6.1f} ms  verify16 {c.verify_s[16] * 1e3:6.1f} ms  "
                  f"draft16 {c.draft_s[16] * 1e3:6.1f} ms", flush=True)
    doc = {"machine": machine(), "rounds": args.rounds}
    for name, cs in runs.items():
        m = median_costs(cs)
        doc[name] = m.to_json()
        doc[name]["draft_dtype"] = variants[name].info.get("draft_dtype")
        print(f"{name:20s} decode {m.decode_s * 1e3:.1f} ms, verify16 {m.verify_s[16] * 1e3:.1f} ms "
              f"({m.verify_s[16] / m.decode_s:.2f}x), draft16 {m.draft_s[16] * 1e3:.1f} ms ({m.draft_s[16] / m.decode_s:.2f}x)")
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
