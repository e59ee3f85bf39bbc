"""The controller on synthetic text, at given step costs: no model runs, so it isolates the policy.

A draft that is right on alternate stretches of `stretch` tokens and wrong between them (every drafted
token right inside a right stretch, none in a wrong one), at the step costs measured on this project's
CPU (benchmarks/results/controller_oracle.json's `costs`, or --costs FILE). Prints and writes modelled
tokens/s of plain decoding, fixed blocks and `auto`, with and without its hot/cold acceptance states,
for several stretch lengths and for a draft that is never right.

    python benchmarks/controller_sim.py [--costs benchmarks/results/controller_oracle.json] \
        [--json benchmarks/results/controller_sim.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_sd.decoding.controller import PLAIN, AutoBlock, Memory  # noqa: E402
from hetero_sd.decoding.costs import Costs  # noqa: E402


def simulate(costs: Costs, right, total: int = 3000, fixed: int | None = None, states: bool = True) -> float:
    """Modelled tokens/s over `total` tokens; right(position) says whether the draft is right there."""
    memory = Memory(costs, 16, learn_costs=False)
    policy = AutoBlock(16, memory)
    if not states:
        policy.STATE_WEIGHT = 1e12  # the states' rates are then the overall rates
    position, seconds = 0, 0.0
    while position < total:
        size = fixed or policy.choose()
        step = memory.cost.step(size)
        seconds += step
        if size == PLAIN:
            policy.observe_plain(step)
            policy.emitted([position])
            position += 1
            continue
        accepted = 0
        while accepted < size - 1 and right(position + 1 + accepted):
            accepted += 1
        policy.observe(size, size - 1, accepted, step)
        policy.emitted(list(range(position, position + accepted + 1)))
        position += accepted + 1
    return position / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--costs", default=str(ROOT / "benchmarks/results/controller_oracle.json"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/controller_sim.json"))
    args = ap.parse_args()
    raw = json.loads(Path(args.costs).read_text())["costs"]
    costs = Costs(decode_s=raw["decode_s"], verify_s={int(k): v for k, v in raw["verify_s"].items()},
                  draft_s={int(k): v for k, v in raw["draft_s"].items()})
    rows = []
    for stretch in (8, 16, 24, 32, 48, 64, None):
        right = (lambda p: False) if stretch is None else (lambda p, s=stretch: (p // s) % 2 == 1)
        row = {"stretch": stretch or "never right", "plain": 1 / costs.decode_s,
               "auto": simulate(costs, right), "auto_without_states": simulate(costs, right, states=False)}
        row.update({f"fixed_{b}": simulate(costs, right, fixed=b) for b in (4, 8, 16)})
        rows.append(row)
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    Path(args.json).write_text(json.dumps({"costs_from": args.costs, "costs": raw, "command": " ".join(sys.argv),
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
