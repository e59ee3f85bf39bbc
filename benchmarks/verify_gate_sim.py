"""The verify gate (sampling.gated, `--verify-gate P`) replayed offline: record, at a fixed block of 8 with the
default pair, each step's draft top probabilities and how many drafts the target accepted; then replay fixed
blocks and gates over the recording with a cost model per step (forward of k rows, the draft's block and
catch-up, the loop's rest: in-loop figures in ms, `--costs`), as speedup over plain decoding.

    python benchmarks/verify_gate_sim.py --record benchmarks/results/verify_gate_zen5/draft_conf_steps_block8.json
    python benchmarks/verify_gate_sim.py --replay benchmarks/results/verify_gate_zen5/draft_conf_steps_block8.json

What it found (Zen 5, 26 Nov 2026): the replay promised +4-9% for block 8 with a gate of 0.3 over the best
fixed block; measured in the loop (results/verify_gate_zen5/loop_chat_gate_fast_conf.json) block 8 went
0.94 -> 1.00-1.06x with the gate, but fixed block 3 gave 1.11-1.14x: the in-loop draft block and rest cost
more than this model's defaults, and they do not shrink with the gate. Off by default.
"""

from __future__ import annotations

import argparse
import json
import math

DEFAULT_COSTS = {"forward": {1: 2.61, 2: 2.90, 4: 3.71, 8: 5.16, 16: 8.42},  # forward_ab.py, this session's after
                 "draft": 0.45, "catch_up": 0.14, "rest_spec": 0.25, "rest_plain": 0.10}


def record(path: str, limit: int) -> None:
    import torch

    import hetero_sd
    from hetero_sd.prompts import load_prompts

    rt = hetero_sd.load("default", "default", block_size=8)
    tops: list[list[float]] = []
    propose = rt.draft.propose

    def recording(*args, **kwargs):
        out = propose(*args, **kwargs)
        tops.append(torch.softmax(getattr(out, "logits", out).float(), -1).amax(-1).tolist())
        return out
    rt.draft.propose = recording
    steps = {}
    for ds in ("chat", "humaneval"):
        steps[ds] = []
        for p in load_prompts(dataset=ds, limit=limit):
            tops.clear()
            g = rt.generate(p.text, max_new_tokens=128, speculative=True, block=8)
            steps[ds] += [{"p": t, "a": a} for t, a in zip(tops, g.stats.accepted_per_step)]
    with open(path, "w") as f:
        json.dump(steps, f)


def replay(path: str, costs: dict) -> dict:
    fw = {int(k): v for k, v in costs["forward"].items()}

    def forward(k: int) -> float:  # linear between measured row counts
        ks = sorted(fw)
        for a, b in zip(ks, ks[1:]):
            if a <= k <= b:
                return fw[a] + (fw[b] - fw[a]) * (k - a) / (b - a)
        raise ValueError(k)
    plain = forward(1) + costs["rest_plain"]

    def speedup(steps, keep) -> float:
        tokens = time = 0.0
        for s in steps:
            n = keep(s["p"])
            tokens += min(s["a"], n) + 1
            time += costs["draft"] + costs["catch_up"] + (costs["rest_spec"] + forward(n + 1) if n else plain)
        return round(tokens / time * plain, 3)

    out = {}
    with open(path) as f:
        data = json.load(f)
    for ds, steps in data.items():
        row = {f"fixed block {b + 1}": speedup(steps, lambda p, b=b: b) for b in (1, 2, 3, 4, 7)}
        for th in (0.3, 0.5, 0.7, 0.9):
            row[f"block 8, gate {th}"] = speedup(steps, lambda p, th=th: next((i for i, x in enumerate(p) if x < th), len(p)))
            row[f"block 8, cumulative gate {th}"] = speedup(
                steps, lambda p, th=th: next((i for i in range(len(p)) if math.prod(p[:i + 1]) < th), len(p)))
        out[ds] = row
        print(ds, json.dumps(row, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record")
    ap.add_argument("--replay")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--costs", help="JSON like DEFAULT_COSTS (ms)")
    args = ap.parse_args()
    if args.record:
        record(args.record, args.limit)
    if args.replay:
        costs = DEFAULT_COSTS
        if args.costs:
            with open(args.costs) as f:
                costs = json.load(f)
        replay(args.replay, costs)


if __name__ == "__main__":
    main()
