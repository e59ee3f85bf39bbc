"""Issue 26: the fused causal attention op alone (SmolLM2-135M's shape: 9 query heads, 3 K/V heads, head
dim 64, a float16 K/V cache) for a decode row and verify blocks of 2..16 rows at --context tokens, per layer,
with K in rows of positions, K tiled by 16 positions (what the target's fused ops keep) and K as tiled q8_0 blocks
(`q8`: kernels/attend_q8.h, llama.cpp's -ctk q8_0; AVX512-VNNI), timed interleaved
(`--rounds` rounds of both, each `--reps` calls) in one process.
Minimum over --reps calls (the call nothing interrupted). --save writes the outputs, --check compares
with a saved file bit for bit (a kernel change must not move a single bit: decode and verify agree only
because every row's sums keep their order).

    python benchmarks/attend_rows.py [--context 512] [--rows 1,2,4,8,16] [--layouts rows,tiled,q8] [--rounds 3]
                                     [--save out.pt | --check out.pt] [--json out.json]
--save/--check hold the outputs of the first layout named. --isa avx2 runs the 8-lane (AVX2) stages here too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from hetero_sd.backends.torch_backend import fused
from hetero_sd.backends.torch_backend.cpu import cpu_flags
from hetero_sd.backends.torch_backend.layers import k_layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402
from timing import options  # noqa: E402


OPTIONS = {"--context": (int, 512), "--rows": (str, "1,2,4,8,16"), "--reps": (int, 300), "--threads": (int, 2),
           "--layouts": (str, "rows,tiled"), "--rounds": (int, 3), "--isa": (str, None),
           "--save": (str, None), "--check": (str, None), "--json": (str, None)}


def main() -> None:
    args = options(OPTIONS)
    torch.set_num_threads(args.threads)
    k = fused.extension()
    wide = "avx512f" in cpu_flags() and args.isa != "avx2"  # --isa avx2: the 8-lane stages on an AVX-512 CPU too
    g = torch.Generator().manual_seed(0)
    cap = args.context + 64
    kc = torch.randn(1, 3, cap, 64, generator=g).half()
    vc = torch.randn(1, 3, cap, 64, generator=g).half()
    layouts = args.layouts.split(",")
    caches = {"rows": kc, "tiled": kc.view(1, 3, cap // 16, 16, 64).transpose(-1, -2).contiguous().view(1, 3, cap, 64)}
    if "q8" in layouts:  # the same keys written by RoPE at angle 0 (x * 1 + rotated * 0 = x) into a q8_0 K cache
        width, dtype = k_layout(64, torch.float16, True)
        caches["q8"], vq = torch.zeros(1, 3, cap, width, dtype=dtype), torch.zeros_like(vc)
        rows = torch.cat([kc[0].transpose(0, 1).reshape(cap, -1), vc[0].transpose(0, 1).reshape(cap, -1).float()], -1)
        k.rope(rows[None], torch.ones(cap, 64), torch.zeros(cap, 64), caches["q8"], vq, 0, 0, 3, None, None, 0.0, True)
        assert torch.equal(vq, vc)
    outs, times = {}, {layout: {} for layout in layouts}
    row_counts = [int(r) for r in args.rows.split(",")]
    queries = {rows: torch.randn(1, 9, rows, 64, generator=g) for rows in row_counts}
    for _ in range(args.rounds):
        for rows in row_counts:
            q, start = queries[rows], args.context - rows
            for layout in layouts:
                best = float("inf")
                for _ in range(args.reps):
                    began = time.perf_counter()
                    o = k.attend(q, caches[layout], vc, start, wide, True, layout != "rows")
                    best = min(best, time.perf_counter() - began)
                if layout == layouts[0]:
                    outs[rows] = o
                times[layout][rows] = min(times[layout].get(rows, float("inf")), best * 1e6)
    for rows in row_counts:
        print(f"rows {rows:3d}: " + ", ".join(f"{layout} {times[layout][rows]:7.1f} us per layer" for layout in layouts)
              + (f"  (tiled/rows {times['tiled'][rows] / times['rows'][rows]:.2f})" if {"rows", "tiled"} <= set(layouts) else "")
              + (f"  (q8/tiled {times['q8'][rows] / times['tiled'][rows]:.2f})" if {"q8", "tiled"} <= set(layouts) else ""))
    if args.save:
        torch.save(outs, args.save)
    if args.check:
        ref = torch.load(args.check)
        same = {r: bool(torch.equal(ref[r], outs[r])) for r in outs if r in ref}
        print("bitwise equal to", args.check, same)
        if not all(same.values()):
            raise SystemExit("outputs moved")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": lscpu(), "context": args.context, "threads": args.threads, "isa": "avx512" if wide else "avx2",
                       "command": " ".join(sys.argv), "rounds": args.rounds, "reps": args.reps,
                       "us_per_layer": times}, f, indent=1)


if __name__ == "__main__":
    main()
