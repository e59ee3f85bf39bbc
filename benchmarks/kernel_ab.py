"""The layer kernels (backends/torch_backend/kernels/fused.cpp and quant8.cpp, the int8-row products) of
another revision against the working tree's, in ONE process: REV's sources are built under their own op
namespaces (hetero_sd_fused_rev, hetero_sd_quant8_rev, REV's layer walk calling REV's products) and the
default target's kernels are switched between the two call by call, so both see the same minute of this
VM, whose speed drifts by 10-30% between minutes (separate processes could not tell 5% apart). Each round
times every row count with each variant in turn (median of `--reps` forwards on top of `--context` tokens),
and the outputs are compared bit for bit (a kernel change must not move one: decode and verify agree only so).
Both use the tree's packed weights (quant.cpp's layout): REV must read them the same way.

    python benchmarks/kernel_ab.py --rev HEAD~1 [--rows 1,8,16] [--rounds 8] [--reps 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import hetero_sd
from hetero_sd.backends.torch_backend import fused, kernels, quant8
from hetero_sd.bench.runner import machine
from hetero_sd.decoding.costs import fill_context, fill_ids, step

ROOT = Path(__file__).resolve().parents[1]
SOURCES = "backends/torch_backend/kernels"


def rev_ops(rev: str) -> tuple[fused.FusedOps, object]:
    """REV's quant8.cpp and fused.cpp built and loaded beside the tree's, under torch.ops.hetero_sd_quant8_rev
    and hetero_sd_fused_rev (REV's walk finds REV's products by that name)."""
    folder = Path(tempfile.mkdtemp())
    headers = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{SOURCES}/"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    for header in (h for h in headers if h.endswith(".h")):  # what REV's sources include (e.g. attend_q8.h)
        (folder / Path(header).name).write_text(subprocess.run(["git", "show", f"{rev}:{header}"], cwd=ROOT, check=True,
                                                               capture_output=True, text=True).stdout)
    built = {}
    for name in ("quant8", "fused"):
        text = subprocess.run(["git", "show", f"{rev}:{SOURCES}/{name}.cpp"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("hetero_sd_quant8", "hetero_sd_quant8_rev").replace("hetero_sd_fused", "hetero_sd_fused_rev")
        (folder / f"{name}_rev.cpp").write_text(text)
        built[name] = kernels.build(f"{name}_rev", folder)
        if isinstance(built[name], Exception):
            raise SystemExit(f"{rev}'s {name}.cpp did not build: {built[name].summary}")
    return fused.FusedOps(built["fused"]), built["quant8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    target = hetero_sd.load("default", None).target
    if not target.fused:
        raise SystemExit("the default target does not use the fused ops here (see its load notes)")
    variants = {args.rev: rev_ops(args.rev), "tree": (target.ops.k, quant8.extension())}
    int8 = [m for m in target.matrices() if isinstance(m, quant8.Int8Blocks)]  # the head's product is called here

    def use(variant) -> None:
        target.ops.k = variant[0]
        for m in int8:
            m.ext = variant[1]

    fill_context(target, None, args.context)
    base = target.length
    ids = {k: fill_ids(k, target.config.vocab_size)[::-1] for k in rows}

    same = {}
    for k in rows:  # the same bits from both
        outs = []
        for variant in variants.values():
            use(variant)
            out = step(target, base, ids[k], True)
            outs.append((out.logits, out.features))
        same[k] = torch.equal(outs[0][0], outs[1][0]) and (outs[0][1] is None or torch.equal(outs[0][1], outs[1][1]))

    def timed(k: int) -> float:  # the cost probe's own call (`bench --costs`): a decode step without features
        began = time.perf_counter()
        step(target, base, ids[k], k > 1)
        return time.perf_counter() - began

    medians = {name: {k: [] for k in rows} for name in variants}
    for name, variant in variants.items():  # warm-up
        use(variant)
        for k in rows:
            for _ in range(5):
                timed(k)
    for r in range(args.rounds):
        order = list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]
        for k in rows:
            for name, variant in order:
                use(variant)
                medians[name][k].append(statistics.median(timed(k) for _ in range(args.reps)) * 1e3)
    ratio = {k: [t / b for t, b in zip(medians["tree"][k], medians[args.rev][k])] for k in rows}
    wins = {k: sum(x < 1 for x in ratio[k]) for k in rows}
    summary = {k: {"rev_ms": round(statistics.median(medians[args.rev][k]), 3),
                   "tree_ms": round(statistics.median(medians["tree"][k]), 3),
                   "tree_over_rev": round(statistics.median(ratio[k]), 4), "tree_faster_rounds": wins[k]}
               for k in rows}
    for k, s in summary.items():
        print(f"rows {k:2d}: {args.rev} {s['rev_ms']:.3f} ms, tree {s['tree_ms']:.3f} ms, tree/rev {s['tree_over_rev']:.3f} "
              f"(tree faster in {s['tree_faster_rounds']} of {args.rounds} rounds), bitwise equal: {same[k]}")
    if args.json:
        doc = {"what": "the tree's layer kernels (fused, quant8) against REV's in one process, alternating (benchmarks/kernel_ab.py)",
               "machine": machine(), "rev": args.rev, "context": args.context, "rounds": args.rounds, "reps": args.reps,
               "bitwise_equal": same, "summary": summary,
               "per_round_ms": {name: {str(k): [round(x, 3) for x in v] for k, v in m.items()} for name, m in medians.items()}}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
