"""The one-call layer walk (fused.py `FusedLayerOps.layers`, kernels/fused.cpp `layers`) against the walk op by
op from Python, in one process, interleaved: a decode step, verify of 2 and 8, the draft's block of 2 and 8, at
--context tokens. Median ms of --rounds rounds x 40 calls each.

    python benchmarks/stack_ab.py --context 512 --json benchmarks/results/stack_ab_avx2.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = hetero_sd.load("default", "default", block_size=8)
    t, d = rt.target, rt.draft
    t.forward(list(range(100, 100 + args.context)), last_only=True, features=False)
    n = t.length
    d.add_context(torch.zeros(n, len(t.layer_ids) * t.config.hidden_size))

    def verify(rows):
        t.crop(n)
        t.forward([5] * rows, features=True)

    calls = {"decode": (verify, 1), "verify-2": (verify, 2), "verify-8": (verify, 8),
             "draft-2": (lambda s: d.propose(5, size=s), 2), "draft-8": (lambda s: d.propose(5, size=s), 8)}
    ms: dict[str, dict[str, list[float]]] = {name: {"op by op": [], "one call": []} for name in calls}
    for _ in range(args.rounds):
        for walk, stack in (("op by op", False), ("one call", True)):
            t.ops.stack = d.model.fused_ops.stack = stack
            for name, (fn, arg) in calls.items():
                for _ in range(5):
                    fn(arg)
                began = time.perf_counter()
                for _ in range(40):
                    fn(arg)
                ms[name][walk].append((time.perf_counter() - began) / 40 * 1000)
    result = {"command": "python " + " ".join(sys.argv), "lscpu": lscpu(), "threads": args.threads,
              "context": args.context, "target": rt.info["weight_plan"],
              "median_ms": {name: {w: round(statistics.median(v), 3) for w, v in m.items()} for name, m in ms.items()}}
    result["one_call_over_op_by_op"] = {name: round(m["one call"] / m["op by op"], 3)
                                        for name, m in result["median_ms"].items()}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
