"""The cost probe (`hetero-sd bench --costs`) of two checkouts, alternating in separate processes on one
machine: `--before` is another checkout (e.g. `git worktree add /tmp/before <commit>`), run through this
venv (benchmarks/ab/sitecustomize.py points the editable install at it); after is this checkout. This VM's
speed drifts by 10-30% between minutes, so only alternating rounds compare: `--rounds` of each, medians of
every call's time in decode steps (each run's own decode step) and in ms.

    python benchmarks/costs_ab.py --before /tmp/before --rounds 5 --json benchmarks/results/costs_ab_X.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import options  # noqa: E402

HERE = Path(__file__).resolve().parent
OPTIONS = {"--before": (str, None), "--rounds": (int, 5), "--json": (str, None)}


def probe(root: str | None) -> dict:
    env = dict(os.environ)
    if root:
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "ab")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["HSD_ROOT"] = str(Path(root).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "costs.json"
        subprocess.run([sys.executable, "-m", "hetero_sd.cli", "bench", "--costs", "--json", str(out)], env=env,
                       cwd=root or HERE.parent, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def calls(costs: dict) -> dict[str, float]:
    c = costs["costs"]
    got = {"decode": c["decode_s"]}
    got.update({f"verify-{k}": v for k, v in c["verify_s"].items()})
    got.update({f"draft-{k}": v for k, v in c["draft_s"].items()})
    return got


def main() -> None:
    args = options(OPTIONS)
    if not args.before:
        raise SystemExit("--before: the other checkout to compare with (git worktree add /tmp/before <commit>)")
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
            runs[side].append(calls(probe(args.before if side == "before" else None)))
            print(side, {k: round(v * 1e3, 2) for k, v in runs[side][-1].items()}, flush=True)
    summary = {}
    for side, per in runs.items():
        names = per[0].keys()
        summary[side] = {name: {"ms": round(statistics.median(r[name] for r in per) * 1e3, 3),
                                "x_decode": round(statistics.median(r[name] / r["decode"] for r in per), 3)}
                         for name in names}
    for name in summary["after"]:
        b, a = summary["before"].get(name), summary["after"][name]
        if b:
            print(f"{name:10s} before {b['ms']:7.2f} ms ({b['x_decode']:.2f} x decode)   after {a['ms']:7.2f} ms "
                  f"({a['x_decode']:.2f} x decode)   after/before {a['ms'] / b['ms']:.3f}")
    if args.json:
        commit = lambda root: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,  # noqa: E731
                                             text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "machine": runs and probe_machine(),
                       "before": commit(args.before), "after": commit(HERE.parent), "rounds": args.rounds,
                       "median": summary, "runs": runs}, f, indent=1)


def probe_machine() -> str:
    from hetero_sd.bench.runner import machine
    return machine()


if __name__ == "__main__":
    main()
