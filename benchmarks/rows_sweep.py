"""What rows cost the int8-row product on a matrix the size of the default target's GGUF blocks: one Q4_1
matrix of --mb MB (more than the L3, so every call streams it from memory, as a forward does), 576 inputs,
times 1-16 rows quantized to int8 (the runtime's qgemm8, 2 threads). Where a call stops being bound by the
bus and starts being bound by the integer dot products is where a verify of k rows starts costing more than
a decode step; `benchmarks/vnni_peak.cpp` measures the CPU's vpdpbusd peak beside it.

    python benchmarks/rows_sweep.py [--mb 94] [--json benchmarks/results/rows_sweep_zen5.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from hetero_sd.backends.torch_backend.quant import Q4_1
from hetero_sd.backends.torch_backend.quant8 import Int8Blocks, isa
from hetero_sd.bench.runner import machine
from timing import median  # noqa: E402  (this folder is on sys.path when run as a script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=94.0, help="the matrix's bytes of Q4_1 blocks (the target's: ~96)")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    K = 576
    N = int(args.mb * 1e6 / (K // 32 * 20)) // 16 * 16
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(N, K // 32, 20), dtype=np.uint8)  # random nibbles, fixed scales
    blocks[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks[:, :, 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    m = Int8Blocks(Q4_1, blocks.reshape(N, -1), None)
    del blocks
    nbytes = N * K // 32 * 20
    out = {"machine": machine(), "isa": isa(), "matrix": {"inputs": K, "outputs": N, "bytes": nbytes},
           "command": "python benchmarks/rows_sweep.py", "rows": {}}
    one = None
    for M in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(M, K)
        for _ in range(4):  # (with timing's own warm-up call: 5 before the timed ones)
            m(x)
        t = median(lambda: m(x), args.reps)
        one = one or t
        out["rows"][M] = {"ms": round(t * 1e3, 3), "GB_per_s": round(nbytes / t / 1e9, 1),
                          "GOPS": round(2 * M * N * K / t / 1e9), "vs_one_row": round(t / one, 2)}
        print(f"{M:2d} rows  {t * 1e3:.3f} ms  {nbytes / t / 1e9:5.1f} GB/s  {2 * M * N * K / t / 1e9:5.0f} GOPS  "
              f"{t / one:.2f}x one row")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
