"""The default target's decode step and verify forwards of 2-16 rows, in two checkouts, alternating in
separate processes: `--before` is another checkout (`git worktree add /tmp/before <commit>`) run through this
venv (benchmarks/ab/sitecustomize.py points the editable install at it); after is this checkout. Each run
fills 512 tokens of context and takes the minimum over `--reps` forwards per row count (with the features, as
the decoding loop's verify): this VM's speed drifts by 10-30% between seconds, and `bench --costs`' medians of
5 calls, run once per side, could not tell a 15% change. `--rounds` runs of each side, in turn; the figure is
each side's median over rounds. Also the prompt's forward of 500 and 1,500 tokens (minimum of 4).

    python benchmarks/forward_ab.py --before /tmp/before --rounds 3 --json benchmarks/results/forward_ab_X.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import options  # noqa: E402

HERE = Path(__file__).resolve().parent
OPTIONS = {"--before": (str, None), "--rounds": (int, 3), "--reps": (int, 80), "--context": (int, 512),
           "--rows": (str, "1,2,4,8,16"), "--json": (str, None)}

# only what both checkouts have: load, forward, crop, fill_ids
CHILD = """
import json, sys, time
import hetero_sd
from hetero_sd.decoding.costs import fill_ids
context, reps, rows = int(sys.argv[1]), int(sys.argv[2]), [int(r) for r in sys.argv[3].split(",")]
t = hetero_sd.load("default", None).target
t.crop(0)
t.forward(fill_ids(context, t.config.vocab_size), last_only=True)
out = {}
for r in rows:
    best = float("inf")
    for i in range(reps + 5):
        t.crop(context)
        began = time.perf_counter()
        t.forward([5] * r, features=True)
        if i >= 5:
            best = min(best, time.perf_counter() - began)
    out[r] = best * 1e3
for n in (500, 1500):  # the prompt's forward (prompt processing), from an empty cache
    ids, best = fill_ids(n, t.config.vocab_size), float("inf")
    for _ in range(4):
        t.crop(0)
        began = time.perf_counter()
        t.forward(ids, last_only=True)
        best = min(best, time.perf_counter() - began)
    out[f"prefill-{n}"] = best * 1e3
print(json.dumps(out))
"""


def run(root: str | None, args) -> dict[str, float]:
    env = dict(os.environ)
    if root:
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "ab")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["HSD_ROOT"] = str(Path(root).resolve())
    done = subprocess.run([sys.executable, "-c", CHILD, str(args.context), str(args.reps), args.rows], env=env,
                          cwd=root or HERE.parent, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = options(OPTIONS)
    if not args.before:
        raise SystemExit("--before: the other checkout to compare with (git worktree add /tmp/before <commit>)")
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
            runs[side].append(run(args.before if side == "before" else None, args))
            print(f"{side:6s}", {k: round(v, 2) for k, v in runs[side][-1].items()}, flush=True)
    med = {side: {k: round(statistics.median(r[k] for r in per), 3) for k in per[0]} for side, per in runs.items()}
    one = args.rows.split(",")[0]
    for k in med["after"]:
        b, a = med["before"][k], med["after"][k]
        if k.startswith("prefill"):
            n = int(k.split("-")[1])
            print(f"{k}: before {n / b * 1e3:6.0f} tok/s  after {n / a * 1e3:6.0f} tok/s  after/before (time) {a / b:.3f}")
            continue
        print(f"rows {k:>2s}: before {b:6.2f} ms ({b / med['before'][one]:.2f} x its {one}-row)  after {a:6.2f} ms "
              f"({a / med['after'][one]:.2f})  after/before {a / b:.3f}")
    if args.json:
        from hetero_sd.bench.runner import machine
        commit = lambda root: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,  # noqa: E731
                                             text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "machine": machine(), "before": commit(args.before),
                       "after": commit(str(HERE.parent)), "context": args.context, "reps": args.reps,
                       "median_of_minima_ms": med, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
