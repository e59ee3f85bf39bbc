"""Training throughput: draft blocks trained per CPU-second, by the trainer's own step loop.

Runs `hetero_sd.train.trainer.train` for --steps steps on the self-distillation shards and writes one JSON:
blocks trained, CPU seconds, wall seconds, blocks per CPU-second (over the steps after --skip, the first
steps pay one-time costs), the config, the CPU model, torch's version and CPU capability, and the git commit.
CPU seconds (the process's, all threads) are what the run got of the machine whatever else ran beside it;
wall seconds on a shared machine mean little.

    python benchmarks/train_throughput.py --steps 30 --json /tmp/throughput.json
    python benchmarks/train_throughput.py --steps 30 --config '{"anchors": 0}' --feature-cache DIR --json ...

Feature computation (the target's forward per sequence) is part of a step when the features are not on
disk; the JSON says how many sequences' features were computed during the measured steps and what that
cost, so a run over a filled cache (--feature-cache) is reported next to its fill cost."""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_sd.loading.sources import resolve_target  # noqa: E402
from hetero_sd.train import trainer  # noqa: E402
from hetero_sd.train.distill import load_distilled  # noqa: E402


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return []


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "hetero_sd/train"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return out.stdout.strip() + (" (hetero_sd/train modified)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the rate (one-time costs)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--distill", default=str(ROOT / "benchmarks/distill-data/SmolLM2-135M-Instruct"))
    ap.add_argument("--init-from", default="cpu-trained")
    ap.add_argument("--config", default="{}", help="JSON: TrainConfig fields to override")
    ap.add_argument("--feature-cache", help="features on disk (TrainConfig.feature_cache), where the trainer has it")
    ap.add_argument("--out", default="/tmp/train-out/throughput", help="the run's folder (checkpoints: not git)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = resolve_target("default")
    rows = load_distilled(Path(args.distill), target)
    from hetero_sd.train.command import init_folder
    fields = dict(layers=2, block_size=16, steps=args.steps, lr=6e-4, eval_every=10**9, seed=0,
                  init=init_folder(args.init_from))
    fields.update(json.loads(args.config))
    if args.feature_cache:
        fields["feature_cache"] = args.feature_cache
    cfg = trainer.TrainConfig(**fields)
    records, counted = [], {"blocks": 0}
    if hasattr(trainer, "make_batch") and not getattr(trainer, "RECORDS_BLOCKS", False):
        make_batch = trainer.make_batch  # the trainer before it counted blocks itself: count its anchors

        def counting(*a, **kw):
            batch = make_batch(*a, **kw)
            counted["blocks"] += int(batch.anchors.shape[0])
            return batch
        trainer.make_batch = counting

    def progress(record):
        record = dict(record)
        record.setdefault("blocks_total", counted["blocks"])
        record["rusage_cpu_s"] = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        records.append(record)

    commit = git_commit()  # before the run: the code that is measured
    out = Path(args.out)
    if (out / "checkpoint.pt").exists() or (out / "checkpoint").exists():
        raise SystemExit(f"{out} holds a checkpoint: give another --out (the benchmark starts fresh)")
    wall0 = time.perf_counter()
    trainer.train(target, rows, out, cfg, progress=progress)
    wall = time.perf_counter() - wall0
    first, last = records[args.skip - 1] if args.skip else None, records[-1]
    blocks = last["blocks_total"] - (first["blocks_total"] if first else 0)
    cpu = last["cpu_s"] - (first["cpu_s"] if first else 0)
    wall_steps = last["elapsed_s"] - (first["elapsed_s"] if first else 0)
    result = {
        "label": args.label, "steps": args.steps, "measured_steps": args.steps - args.skip,
        "blocks": blocks, "cpu_s": round(cpu, 2), "wall_s": round(wall_steps, 2),
        "blocks_per_cpu_s": round(blocks / cpu, 3), "cpu_s_per_block_ms": round(1000 * cpu / blocks, 2),
        "features_computed": {k: last.get(k) for k in ("features_computed", "features_cpu_s") if k in last},
        "whole_run_wall_s": round(wall, 1), "threads": args.threads,
        "config": {k: v for k, v in vars(cfg).items() if k != "history"},
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "git_commit": commit, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_at_end": list(__import__("os").getloadavg()),
        "per_step": [{k: r.get(k) for k in ("step", "loss", "cpu_s", "elapsed_s", "blocks_total")} for r in records],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("blocks", "cpu_s", "wall_s", "blocks_per_cpu_s", "cpu_s_per_block_ms")}))


if __name__ == "__main__":
    main()
