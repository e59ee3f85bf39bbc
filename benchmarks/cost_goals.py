"""Issue 26's cost goals, run by run, from the JSON that `hetero-sd bench --costs --json F` writes: decode within
1.3x its floor, verify-8 <= 1.4 and verify-16 <= 2.0 decode steps, a draft block <= 0.2 decode steps. Each run is
judged alone (the goals are ratios of one run's calls: a VM whose bus speed changes from minute to minute moves
them together), with the bus probe's reading beside it.

    python benchmarks/cost_goals.py benchmarks/results/final_18th_zen5/costs_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOALS = {"decode / floor": 1.3, "verify-8": 1.4, "verify-16": 2.0, "draft-2": 0.2}


def figures(costs: dict) -> dict[str, float | None]:
    decode = costs["decode_s"]
    verify, draft = costs["verify_s"], costs.get("draft_s") or {}
    return {"decode / floor": decode / costs["floors_s"]["decode"],
            "verify-8": verify["8"] / decode if "8" in verify else None,
            "verify-16": verify["16"] / decode if "16" in verify else None,
            "draft-2": draft["2"] / decode if "2" in draft else None}


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    if not paths:
        raise SystemExit("usage: python benchmarks/cost_goals.py COSTS.json [...] (from hetero-sd bench --costs --json)")
    print(f"{'run':40s} {'bus GB/s':>8s} {'decode ms':>9s} " + " ".join(f"{g + ' <= ' + str(v):>16s}" for g, v in GOALS.items())
          + "  all")
    for path in paths:
        try:
            costs = json.loads(path.read_text())["costs"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{path}: not a bench --costs JSON ({type(e).__name__}: {e})")
        got = figures(costs)
        met = {g: v is not None and v <= GOALS[g] for g, v in got.items()}
        cells = " ".join(f"{('-' if v is None else f'{v:.2f}') + (' met' if met[g] else '    '):>16s}" for g, v in got.items())
        print(f"{str(path)[-40:]:40s} {costs['bandwidth_gbs']:8.1f} {costs['decode_s'] * 1e3:9.2f} {cells}  "
              f"{'yes' if all(met.values()) else 'no'}")


if __name__ == "__main__":
    main()
