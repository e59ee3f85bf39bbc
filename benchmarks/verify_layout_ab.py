"""Issue 26: the default target's decode step and verify forwards of 2-16 rows with its K cache in rows of
positions (before) and tiled by 16 positions (after: kernels/fused.cpp scores_tiled), in ONE process,
interleaved `--rounds` times, each first in turn (this VM's speed drifts by 10-30% between minutes: only a same-process,
alternating comparison means anything). Each (round, layout, rows) times `--steps` forwards at `--context`
tokens (the cache cropped back before each); the figure is the median over rounds of their mean. Each
layout fills its own cache first (the two layouts are not each other's bytes).

    python benchmarks/verify_layout_ab.py [--context 512] [--rows 1,2,4,8,16] [--rounds 5] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import hetero_sd
from hetero_sd.bench.runner import machine
from hetero_sd.decoding.costs import fill_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import options  # noqa: E402

OPTIONS = {"--context": (int, 512), "--rows": (str, "1,2,4,8,16"), "--rounds": (int, 5), "--steps": (int, 40),
           "--json": (str, None)}


def main() -> None:
    args = options(OPTIONS)
    target = hetero_sd.load("default", None).target
    if not getattr(target.ops, "tiled", False):
        raise SystemExit("the target does not run the C++ attention on this machine: nothing to compare")
    rows = [int(r) for r in args.rows.split(",")]
    ids = fill_ids(args.context, target.config.vocab_size)
    ms: dict[str, dict[int, list[float]]] = {layout: {r: [] for r in rows} for layout in ("rows", "tiled")}
    for i in range(args.rounds):
        for layout in (("rows", "tiled") if i % 2 == 0 else ("tiled", "rows")):  # either goes first in turn
            target.ops.tiled = layout == "tiled"
            target.crop(0)
            target.forward(ids, last_only=True)
            for r in rows:
                target.crop(args.context)
                target.forward([5] * r)  # warm-up
                began = time.perf_counter()
                for _ in range(args.steps):
                    target.crop(args.context)
                    target.forward([5] * r)
                ms[layout][r].append((time.perf_counter() - began) / args.steps * 1e3)
    target.ops.tiled = True
    med = {layout: {r: statistics.median(v) for r, v in per.items()} for layout, per in ms.items()}
    for r in rows:
        line = ", ".join(f"{layout} {med[layout][r]:6.2f} ms ({med[layout][r] / med[layout][rows[0]]:.2f} x its {rows[0]}-row)"
                         for layout in med)
        print(f"rows {r:2d}: {line}; tiled/rows {med['tiled'][r] / med['rows'][r]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "target": "default", "context": args.context, "rounds": args.rounds,
                       "steps": args.steps, "command": "python " + " ".join(sys.argv), "median_ms": med,
                       "per_round_ms": ms}, f, indent=1)


if __name__ == "__main__":
    main()
