"""Issue 26: the int8-row kernel (quant8.py) against the float32-row one (quant.py) per matrix of the default
target (SmolLM2-135M shapes, random GGUF blocks: the time does not depend on the values), for 1..64 rows.
Minimum over `--reps` calls (the machine is shared: the minimum is the call nothing interrupted), one torch
thread by default (a per-core figure, less sensitive to the other jobs than two threads).

    python benchmarks/int8_rows.py [--threads 1] [--reps 30] [--rows 1,2,4,8,16,32,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hetero_sd.backends.torch_backend import quant, quant8

from timing import best  # noqa: E402  (this folder is on sys.path when run as a script)

# (name, kind, out, in): the layer's fused matrices and the head (tied embedding, Q8_0)
SHAPES = [("qkv", quant.Q4_1, 960, 576), ("o", quant.Q4_1, 576, 576), ("gate_up", quant.Q4_1, 3072, 576),
          ("down", quant.Q4_1, 576, 1536), ("head", quant.Q8_0, 49152, 576)]


def random_rows(kind: str, n: int, k: int):
    g = torch.Generator().manual_seed(0)
    kb = k // 32
    scale = lambda lo, hi: (torch.rand(n, kb, generator=g) * (hi - lo) + lo).half().view(torch.uint8).view(n, kb, 2)  # noqa: E731
    quants = torch.randint(0, 256, (n, kb, 16 if kind == quant.Q4_1 else 32), generator=g, dtype=torch.uint8)
    parts = [scale(0.001, 0.02), scale(-0.15, 0.0), quants] if kind == quant.Q4_1 else [scale(0.0005, 0.01), quants]
    return torch.cat(parts, -1).reshape(n, -1).numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    out = {"command": " ".join(["python"] + sys.argv), "threads": args.threads, "reps": args.reps,
           "isa": {"float32": quant.isa(), "int8": quant8.isa()}, "us": {}}
    for name, kind, n, k in SHAPES:
        data = random_rows(kind, n, k)
        f32, i8 = quant.Quantized(kind, data, None), quant8.Int8Blocks(kind, data, None)
        for m in rows:
            x = torch.randn(m, k)
            a, b = best(lambda: f32(x), args.reps), best(lambda: i8(x), args.reps)
            out["us"][f"{name} x{m}"] = {"float32": round(a * 1e6, 1), "int8": round(b * 1e6, 1),
                                         "int8/float32": round(b / a, 3)}
            print(f"{name:8s} rows {m:3d}  float32 {a * 1e6:9.1f} us  int8 {b * 1e6:9.1f} us  ({b / a:.2f}x)  "
                  f"int8 per row {b / m * 1e6:8.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
