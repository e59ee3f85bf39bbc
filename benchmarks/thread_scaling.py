"""Issue 26: how a decode step and verifies of k rows scale from 1 to N torch threads on the default target (the
cost probe's call, on --context tokens), in ONE process, the thread counts alternating round by round. Speedup
over one thread and parallel efficiency (speedup / threads): what waiting, imbalance and serial glue leave of the
threads' work; a memory-bound decode step scales by the bus, not the cores.

    python benchmarks/thread_scaling.py [--ks 1,8,16] [--threads 1,2] [--rounds 6] --json out.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import hetero_sd
from hetero_sd.decoding.costs import fill_context, fill_ids, step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402
from timing import median, options  # noqa: E402

OPTIONS = {"--ks": (str, "1,8,16"), "--threads": (str, "1,2"), "--context": (int, 512), "--rounds": (int, 6),
           "--reps": (int, 25), "--json": (str, None)}


def main() -> None:
    args = options(OPTIONS)
    counts = [int(t) for t in args.threads.split(",")]
    target = hetero_sd.load("default", None).target
    fill_context(target, None, args.context)
    base = target.length
    out = {"what": "default target, median ms of the cost probe's call per thread count, alternating rounds",
           "command": " ".join(["python"] + sys.argv), "lscpu": lscpu(), "context": args.context,
           "target": target.mode, "ms": {}, "speedup": {}, "efficiency": {}}
    for k in (int(x) for x in args.ks.split(",")):
        ids = fill_ids(k, target.config.vocab_size)[::-1]
        ms = {t: [] for t in counts}
        for r in range(args.rounds):
            for t in (counts if r % 2 == 0 else counts[::-1]):
                torch.set_num_threads(t)
                for _ in range(4):  # (and median's own warm-up call: the new thread count's team is up)
                    step(target, base, ids, k > 1)
                ms[t].append(median(lambda: step(target, base, ids, k > 1), args.reps) * 1e3)
        med = {t: statistics.median(v) for t, v in ms.items()}
        name = "decode" if k == 1 else f"verify {k}"
        out["ms"][name] = {str(t): round(v, 3) for t, v in med.items()}
        out["speedup"][name] = {str(t): round(med[counts[0]] / v, 3) for t, v in med.items()}
        out["efficiency"][name] = {str(t): round(med[counts[0]] / v / (t / counts[0]), 3) for t, v in med.items()}
        print(f"{name:10s} " + "  ".join(f"{t} threads {v:6.2f} ms ({med[counts[0]] / v:.2f}x)" for t, v in med.items()),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
