"""Why the torch backend stores weights transposed: F.linear(x, W[out,in]) vs x @ W_t[in,out] on this CPU,
for the row counts of a decode step (1) and a DFlash verify step (16), at SmolLM2's shapes.

    python benchmarks/matmul_layout.py --json benchmarks/results/matmul_layout.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from hetero_sd.bench.runner import machine

SHAPES = {"qkv (576->960)": (576, 960), "gate_up (576->3072)": (576, 3072), "down (1536->576)": (1536, 576),
          "lm_head (576->49152)": (576, 49152)}


def per_call(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for name, (d_in, d_out) in SHAPES.items():
        w = torch.randn(d_out, d_in)
        w_t = w.t().contiguous()
        reps = 20 if d_out > 10000 else 200
        for rows_ in (1, 16):
            x = torch.randn(rows_, d_in)
            a = per_call(lambda: F.linear(x, w), reps)
            b = per_call(lambda: x @ w_t, reps)
            rows.append({"weight": name, "rows": rows_, "linear_us": a * 1e6, "transposed_us": b * 1e6,
                         "ratio": a / b})
            print(f"{name:24s} rows={rows_:2d}  F.linear {a * 1e6:8.0f} us   x@W_t {b * 1e6:8.0f} us   "
                  f"ratio {a / b:4.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
