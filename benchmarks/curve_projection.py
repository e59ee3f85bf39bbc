"""What more training would take: fit the learning curve's held-out simulated decoding (eval_heldout.py's
points) against ln(blocks trained) and solve for the blocks, and CPU-hours at the run's own measured rate,
at which each goal of issue 25 would be met, if the trend held.

    python benchmarks/curve_projection.py --curve benchmarks/results/training/b8g2-curve.json \
        --json benchmarks/results/training/b8g2-projection.json

A straight line in ln(blocks) is the usual shape of such curves over a decade or two; it says nothing about
where a 2-layer draft's capacity ends (a flattening fit means "further than this"), and the later points
mix in the learning rate's cosine decay. Points below --min-blocks (the first minutes of a run) are left
out of the fit. The goals are on held-out replay, the proxy for real decoding that eval_heldout.py
measures: chat (ShareGPT rows) position 1 and tau, code (stdlib rows) tau."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

# (source, measure, goal): issue 25's goals (chat position 1 >= 55%, chat tau >= 2.2, HumanEval tau >= 2.6)
ANSWER_POSITIONS = 2.13e6  # the self-distillation shards' answer tokens (train_draft.sh's log: 2,132,695)
GOALS = (("sharegpt", "position_1_right", 0.55), ("sharegpt", "tau", 2.2), ("stdlib", "tau", 2.6))


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, r^2)."""
    b, a = statistics.linear_regression(xs, ys)
    r2 = statistics.correlation(xs, ys) ** 2 if len(set(ys)) > 1 else 1.0
    return a, b, r2


def project(points: list[dict], min_blocks: int) -> dict:
    used = [p for p in points if (p.get("blocks_trained") or 0) >= min_blocks]
    if len(used) < 3:
        raise SystemExit(f"curve has {len(used)} points with >= {min_blocks} blocks trained: need 3 to fit")
    last = used[-1]
    blocks_per_cpu_hour = last["blocks_trained"] / last["cpu_hours"]
    xs = [math.log(p["blocks_trained"]) for p in used]
    out = {"points_fitted": len(used), "from_blocks": used[0]["blocks_trained"], "to_blocks": last["blocks_trained"],
           "cpu_hours_so_far": last["cpu_hours"], "blocks_per_cpu_hour": round(blocks_per_cpu_hour), "goals": []}
    for source, measure, goal in GOALS:
        ys = [p["simulated"][source][measure] for p in used]
        a, b, r2 = fit(xs, ys)
        row = {"source": source, "measure": measure, "goal": goal, "now": ys[-1],
               "gain_per_doubling": round(b * math.log(2), 4), "r2": round(r2, 4)}
        block = last.get("block_size")
        if measure == "tau" and block and goal > block:  # a block of B gives at most B tokens a step
            row["verdict"] = f"out of scale: tau at blocks of {block} is at most {block} (project the block-8 curve)"
        elif ys[-1] >= goal:
            row["verdict"] = "met"
        elif b <= 0:
            row["verdict"] = "not rising: more of the same training does not reach it"
        else:
            need = math.exp((goal - a) / b)
            row.update(blocks_needed=round(need), times_blocks_so_far=round(need / last["blocks_trained"], 1),
                       cpu_hours_total=round(need / blocks_per_cpu_hour, 1),
                       cpu_hours_more=round((need - last["blocks_trained"]) / blocks_per_cpu_hour, 1),
                       # > ~3 passes over the same 2.13M answer positions means more data, not only more steps
                       passes_over_answer_positions=round(need / ANSWER_POSITIONS, 1))
            row["verdict"] = "if the trend held"
        out["goals"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curve", required=True)
    ap.add_argument("--min-blocks", type=int, default=500_000)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"curve": args.curve, "min_blocks": args.min_blocks,
              **project(json.loads(Path(args.curve).read_text())["points"], args.min_blocks)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
