"""Simulated-decoding tau on the fixed held-out rows of the shards, by source (chat = ShareGPT, code =
stdlib), next to the 1-3-gram floor; appends a learning-curve point when given a training run.

    python benchmarks/eval_heldout.py --draft cpu-trained --block-size 2 --json benchmarks/results/heldout/block2.json
    python benchmarks/eval_heldout.py --run /tmp/train-out/e2 --curve benchmarks/results/training/e2-curve.json

Held-out rows: the 256 smallest key hashes of the shards (hetero_sd/train/trainer.py split_held_out), which
no run of `benchmarks/train_draft.sh` (--held-out 256) trains on. Each row is replayed for its
first --max-tokens answer tokens (hetero_sd/train/evaluate.py). Features come from --feature-cache (a
training run's store holds them once its evaluation has read them) or are computed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_sd.bench.runner import machine  # noqa: E402
from hetero_sd.cli.policy import policy_from_env  # noqa: E402
from hetero_sd.devices import capability  # noqa: E402
from hetero_sd.errors import ConfigError  # noqa: E402
from hetero_sd.loading.sources import resolve_target  # noqa: E402
from hetero_sd.models.config import ArchConfig, read_json  # noqa: E402
from hetero_sd.train.command import init_folder  # noqa: E402
from hetero_sd.train.distill import load_distilled  # noqa: E402
from hetero_sd.train.evaluate import NGramDraft, draft_tau, ngram_tau  # noqa: E402
from hetero_sd.train.trainer import FeatureCache, split_held_out  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", action="append", default=[], help="draft folder or shipped name (repeatable)")
    ap.add_argument("--run", help="a training run's folder: its current draft, a learning-curve point")
    ap.add_argument("--curve", help="learning-curve JSON to append the --run point to")
    ap.add_argument("--held-out", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="the block the floor and every draft are replayed at")
    ap.add_argument("--distill", default=str(ROOT / "benchmarks/distill-data/SmolLM2-135M-Instruct"))
    ap.add_argument("--feature-cache", help="the features' store (default: /tmp/train-out/features for float32, "
                    "/tmp/train-out/heldout-int8-<K cache> for int8: a store holds one kind)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--feature-numerics", choices=["float32", "int8"], default="float32",
                    help="the target's rows for the features (int8: the runtime's; its own --feature-cache)")
    ap.add_argument("--train-rows", type=int, default=0,
                    help="replay N rows the run TRAINED on instead (every k-th of the training rows, the same split): "
                         "the gap to the held-out figures says whether the draft overfits its data")
    ap.add_argument("--lookup", type=float, default=0.0,
                    help="the context lookup's weight in each draft's proposals (decoding/lookup.py; 0: off)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k_q8 = policy_from_env().k_q8  # int8 features: the runtime's K cache (HETERO_SD_KV)
    if args.feature_cache is None:
        args.feature_cache = "/tmp/train-out/features" if args.feature_numerics == "float32" else \
            f"/tmp/train-out/heldout-int8-{'q8k' if k_q8 else 'f16k'}"
    target = resolve_target("default")
    rows = load_distilled(Path(args.distill), target)
    held, rest = split_held_out(rows, args.held_out, 0)
    if args.train_rows:  # the floor's table then counts these rows too: read it as an upper bound
        stride = max(1, len(rest) // args.train_rows)
        held = rest[::stride][:args.train_rows]
    held = [r for r in held if len(r["response_ids"]) > 1]
    cpu0 = time.process_time()
    result = {"held_out_rows": 0 if args.train_rows else len(held), "training_rows": len(held) if args.train_rows else 0, "max_tokens": args.max_tokens, "block_size": args.block_size,
              "lookup": args.lookup,
              "ngram_floor": ngram_tau(NGramDraft(rest), held, args.block_size, args.max_tokens)}
    drafts = [(name, init_folder(name)) for name in args.draft]
    if args.run:
        drafts.append(("run", args.run))
    features = None
    for name, folder in drafts:
        raw = read_json(Path(folder) / "config.json")
        if features is None:
            tcfg = ArchConfig.from_dict(read_json(target / "config.json"))
            features = FeatureCache(target, raw["dflash_config"]["target_layer_ids"], budget_bytes=0,
                                    disk=Path(args.feature_cache) if args.feature_cache else None,
                                    numerics=args.feature_numerics, k_q8=k_q8)
        result[name] = draft_tau(Path(folder), features, held, args.max_tokens, args.block_size, args.lookup)
    if features is not None and features.disk is not None:
        features.disk.flush()
    result["cpu_s"] = round(time.process_time() - cpu0, 1)
    result["command"] = " ".join(["python"] + sys.argv)
    result["machine"] = {**machine(), "capability": capability()}
    result["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.run and args.curve:
        log = [json.loads(line) for line in (Path(args.run) / "log.jsonl").read_text().splitlines() if line.strip()]
        state = json.loads((Path(args.run) / "training.json").read_text())
        at = next((r for r in reversed(log) if r["step"] == state["step"]), log[-1])
        curve = json.loads(Path(args.curve).read_text()) if Path(args.curve).is_file() else {"points": []}
        curve["points"].append({"step": at["step"], "blocks_trained": at.get("blocks_total"),
                                "cpu_hours": round(at["cpu_s"] / 3600, 3), "teacher_forced_tau": at.get("held_out_tau"),
                                "block_size": args.block_size,
                                "simulated": result["run"], "ngram_floor": result["ngram_floor"],
                                "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
        Path(args.curve).write_text(json.dumps(curve, indent=1) + "\n")


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # e.g. a --feature-cache of another kind of features
        sys.exit(f"error: {e}")
