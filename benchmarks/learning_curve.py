"""Learning curve of the default draft's training: held-out tau by real decoding, against training
compute, for every snapshot a training run kept (`train-draft --snapshots`, benchmarks/train_draft.sh).

For each snapshot (and for a starting draft such as `cpu-trained`) the runtime decodes, at T=0 with a
fixed block (the draft's own size, 16) and the float32 target: prompts of the training mix that were
held out of training (the trainer's own held-out rows, chosen by a hash of their key), the project's chat
set and HumanEval (evaluation sets: never in the training mix). tau and per-position acceptance come
from the runtime's stats. The teacher-forced held-out tau and the CPU seconds at that step come from the
run's log.jsonl.

    python benchmarks/learning_curve.py --runs /work/jobs/train-hard /work/jobs/train-soft \
        --start cpu-trained --prompts 6 --max-new-tokens 64 \
        --json benchmarks/results/learning_curve.json"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetero_sd  # noqa: E402
from hetero_sd.bench.runner import machine  # noqa: E402
from hetero_sd.prompts import load_prompts  # noqa: E402
from hetero_sd.loading.sources import resolve_target  # noqa: E402
from hetero_sd.train.distill import load_distilled  # noqa: E402
from hetero_sd.train.trainer import split_held_out  # noqa: E402

DATA = ROOT / "benchmarks/distill-data/SmolLM2-135M-Instruct"


def prompt_sets(count: int) -> dict[str, list]:
    rows = load_distilled(DATA, resolve_target("default"), log=lambda line: print(line, file=sys.stderr))
    held, _ = split_held_out(rows, 24, 0)  # the trainer's held-out rows (TrainConfig: held_out=24, seed=0)
    return {"held-out": [r["prompt_ids"] for r in held[:count]],
            "chat": [p.text for p in load_prompts(None, "chat", count)],
            "humaneval": [p.text for p in load_prompts(None, "humaneval", count)]}


def evaluate(draft: str, sets: dict[str, list], max_new: int) -> dict:
    rt = hetero_sd.load("default", draft, block_size="fixed")
    out = {}
    for name, prompts in sets.items():
        accepted, drafted = [], []
        for p in prompts:
            g = rt.generate(p, max_new_tokens=max_new, stop_at_eos=True)
            accepted += g.stats.accepted_per_step
            drafted += g.stats.drafted_per_step
        width = max(drafted, default=0)
        per_position = []  # conditional: P(position i right | positions before it right)
        for i in range(1, min(width, 4) + 1):
            reached = [a for a, d in zip(accepted, drafted) if d >= i and a >= i - 1]
            per_position.append(sum(a >= i for a in reached) / max(len(reached), 1))
        out[name] = {"tau": 1 + sum(accepted) / max(len(accepted), 1), "steps": len(accepted),
                     "position_rates": [round(r, 3) for r in per_position]}
    rt.close()
    return out


def log_at(run: Path, step: int) -> dict:
    for line in (run / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step:
            return record
    return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="*", default=[])
    ap.add_argument("--start", default="cpu-trained", help="the draft the runs started from (step 0)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--every", type=int, default=1, help="evaluate every n-th snapshot")
    ap.add_argument("--last", action="store_true", help="evaluate only each run's latest snapshot")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/learning_curve.json"))
    args = ap.parse_args()
    sets = prompt_sets(args.prompts)
    points = [{"run": "start", "draft": args.start, "step": 0, "cpu_s": 0.0, **evaluate(args.start, sets, args.max_new_tokens)}]
    print(json.dumps(points[-1]), flush=True)
    for run in map(Path, args.runs):
        snaps = sorted((run / "snapshots").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        for snap in snaps[-1:] if args.last else snaps[args.every - 1::args.every]:
            step = int(snap.name.split("-")[1])
            record = log_at(run, step)
            began = time.perf_counter()
            point = {"run": run.name, "draft": str(snap), "step": step, "cpu_s": record.get("cpu_s"),
                     "teacher_forced_tau": record.get("held_out_tau"), **evaluate(str(snap), sets, args.max_new_tokens)}
            points.append(point)
            print(json.dumps(point), f"({time.perf_counter() - began:.0f} s)", flush=True)
    doc = {"machine": machine(), "command": " ".join(sys.argv), "settings": vars(args), "points": points}
    Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
