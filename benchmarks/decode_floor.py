"""Issue 26: how far the default target's decode step is from its memory floor, measured so that the ratio
survives this VM's noisy memory bandwidth (one probe read 27 GB/s, another session 44 GB/s on the same host
type). Each round measures, back to back in one process, the read bandwidth (hetero_sd.bench.floor's probe:
the best of 5 full reads of a 512 MB buffer, the process's threads) and the median of --steps decode steps at
--context tokens; the floor is (weight bytes + K/V bytes of the context) / that round's bandwidth. The ratio
step / floor is reported per round, with its median and spread: a drift of the machine moves both.

    python benchmarks/decode_floor.py [--rounds 5] [--steps 100] [--context 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import hetero_sd
from hetero_sd.bench.floor import target_bytes  # the bytes a step reads (GGUF blocks)
from hetero_sd.decoding.costs import fill_ids, read_bandwidth_gb_s

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    rt = hetero_sd.load("default", None)
    target = rt.target
    weights, kv = target_bytes(target)
    step_bytes = weights + kv * args.context
    target.crop(0)
    target.forward(fill_ids(args.context, target.config.vocab_size), last_only=True)
    rounds = []
    for r in range(args.rounds):
        bandwidth = read_bandwidth_gb_s()
        times = []
        for _ in range(args.steps + 10):
            target.crop(args.context)
            began = time.perf_counter()
            target.forward([5])
            times.append(time.perf_counter() - began)
        step = statistics.median(times[10:])
        floor = step_bytes / (bandwidth * 1e9)
        rounds.append({"bandwidth_gb_s": round(bandwidth, 2), "step_ms": round(step * 1e3, 3),
                       "floor_ms": round(floor * 1e3, 3), "step_over_floor": round(step / floor, 3)})
        print(f"round {r}: bandwidth {bandwidth:5.1f} GB/s  step {step * 1e3:6.3f} ms  floor {floor * 1e3:6.3f} ms  "
              f"ratio {step / floor:.2f}", flush=True)
    ratios = [x["step_over_floor"] for x in rounds]
    summary = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(f"step / floor: median {summary['median']:.2f} (min {summary['min']:.2f}, max {summary['max']:.2f}); "
          f"weights {weights / 1e6:.1f} MB + K/V {kv * args.context / 1e6:.1f} MB per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": lscpu(), "command": " ".join(["python"] + sys.argv), "target": rt.info.get("weight_plan"),
                       "weight_bytes": weights, "kv_bytes_per_position": kv, "context": args.context,
                       "rounds": rounds, "step_over_floor": summary}, f, indent=1)


if __name__ == "__main__":
    main()
