"""Decode, verify and draft costs of two revisions of this tree, interleaved: the cost probe
(`hetero-sd bench --costs --json`) alternately on a git worktree of REV and on the working tree, `--rounds`
times each, medians per cost (the machine is shared across sessions: only same-minute alternations compare).
Both run from the same venv (the worktree first on PYTHONPATH) with their own shipped drafts; `--env` adds
variables to the tree's runs only (e.g. HETERO_SD_DRAFT_VOCAB=off to give it the full head REV had).

    python benchmarks/revision_costs_ab.py --rev 61aff88 --rounds 3 --env HETERO_SD_DRAFT_VOCAB=off \\
        --json benchmarks/results/redesign_costs_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree(rev: str) -> Path:
    """REV checked out, and beside it a folder to put on PYTHONPATH: hetero_sd/ whose entries link to the
    worktree's, plus backends/, ane_compiler/ and tui/ linked in as pyproject's package-dir ships them
    (else the venv's editable install would answer `hetero_sd.backends` from this tree)."""
    path = Path(tempfile.gettempdir()) / f"hetero-sd-rev-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True)
    pkg = path.with_name(path.name + "-pkg") / "hetero_sd"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for entry in (path / "hetero_sd").iterdir():
            (pkg / entry.name).symlink_to(entry)
        for sub in ("backends", "ane_compiler", "tui"):
            (pkg / sub).symlink_to(path / sub)
    return pkg.parent


def probe(tree: Path | None, threads: int, extra_env: dict[str, str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, **extra_env)
        if tree is not None:  # None: the working tree, as the venv's editable install has it
            env["PYTHONPATH"] = str(tree)
        subprocess.run([sys.executable, "-m", "hetero_sd.cli", "bench", "--costs", "--threads", str(threads),
                        "--json", out.name], env=env, check=True, stdout=subprocess.DEVNULL,
                       cwd=tempfile.gettempdir())  # not this tree: '' on sys.path would shadow PYTHONPATH
        return json.loads(Path(out.name).read_text())


def costs_of(result: dict) -> dict[str, float]:
    """Flat {name: ms} of one probe's JSON (the costs object is under 'costs' when bench wraps it)."""
    c = result.get("costs", result)
    flat = {"decode_ms": 1e3 * c["decode_s"]}
    flat.update({f"verify{k}_ms": 1e3 * v for k, v in c["verify_s"].items()})
    flat.update({f"draft{k}_ms": 1e3 * v for k, v in c["draft_s"].items()})
    return flat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the working tree's runs")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    before_tree = worktree(args.rev)
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        for side, tree, env in (("before", before_tree, {}), ("after", None, extra)):
            runs[side].append(costs_of(probe(tree, args.threads, env)))
            print(f"round {r + 1} {side}: {runs[side][-1]}", flush=True)
    med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in runs.items()}
    ratio = {k: med["after"][k] / med["before"][k] for k in med["before"] if k in med["after"]}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    out = {"what": "cost probe of two revisions, interleaved, medians (ms)", "before_rev": args.rev,
           "after_rev": f"{head} (working tree)", "after_env": extra, "threads": args.threads, "cpu": cpu,
           "cores": os.cpu_count(), "load_average": os.getloadavg(), "rounds": args.rounds,
           "command": " ".join(sys.argv), "median_ms": med, "after_over_before": ratio, "runs": runs}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(ratio, indent=1))


if __name__ == "__main__":
    main()
