"""Overlap vs sequential, and how the gain scales with the draft's cost.

Runs hetero_sd.bench.experiments.placement_sweep on the default target with untrained drafts of 1, 2, 4 and 8
layers (deeper = costlier draft; acceptance is ~0 for all, which is the worst case for `overlap` and
irrelevant to `pipeline`), target and draft on the CPU with one torch thread each, schedules
sequential / overlap / pipeline on the same prompts in one process. Optionally add trained drafts.

    python benchmarks/schedules.py --json benchmarks/results/schedules.json
    python benchmarks/schedules.py --drafts random:2,/path/to/trained --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

from hetero_sd.bench.experiments import placement_sweep
from hetero_sd.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default="random:1,random:2,random:4,random:8")
    ap.add_argument("--schedules", default="sequential,overlap,pipeline")
    ap.add_argument("--prompts", type=int, default=4, help="first N of the built-in chat set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per lane")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    prompts = [p.text for p in load_prompts(limit=args.prompts)]
    table = placement_sweep(drafts=args.drafts.split(","), devices=[("cpu", "cpu")],
                            schedules=args.schedules.split(","), prompts=prompts,
                            max_new_tokens=args.max_new_tokens, cpu_threads=args.threads)
    table.settings["command"] = " ".join(sys.argv)
    for r in table.rows:  # wall-time ratio against the sequential schedule of the same draft
        seq = next(x for x in table.rows if x["draft"] == r["draft"] and x["schedule"] == "sequential")
        r["vs_sequential"] = r["tokens_per_s"] / seq["tokens_per_s"]
    table.print()
    table.save(args.json)
    print(json.dumps([(r["draft"], r["schedule"], round(r["draft_to_verify_cost"] or 0, 2),
                       round(r["vs_sequential"], 2)) for r in table.rows]))


if __name__ == "__main__":
    main()
