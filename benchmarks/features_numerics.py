"""Does the draft see other context features at run time than in training? Training computes the target's
features with float32 rows (train/trainer.py FeatureCache); the runtime's default target multiplies int8 rows
(llama.cpp's numerics) with a float16 K/V cache. Held-out simulated decoding (train/evaluate.py draft_tau) of
one draft, fed either target's features, on the same held-out rows.

    python benchmarks/features_numerics.py --draft /work/train-out/b8g2 --rows 120 --json benchmarks/results/training/features_numerics.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_sd.backends.policy import DEFAULT  # noqa: E402
from hetero_sd.backends.torch_backend import TorchTarget, load_weights  # noqa: E402
from hetero_sd.backends.torch_backend.cpu import cpu_flags  # noqa: E402
from hetero_sd.loading.sources import resolve_target  # noqa: E402
from hetero_sd.models.config import ArchConfig, read_json  # noqa: E402
from hetero_sd.train.command import init_folder  # noqa: E402
from hetero_sd.train.distill import load_distilled  # noqa: E402
from hetero_sd.train.evaluate import draft_tau  # noqa: E402
from hetero_sd.train.trainer import FeatureCache, split_held_out  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from int8_ab import lscpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="default", help="draft folder or shipped name")
    ap.add_argument("--rows", type=int, default=120, help="the first N of the 256 held-out rows")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--distill", default=str(ROOT / "benchmarks/distill-data/SmolLM2-135M-Instruct"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, folder = resolve_target("default"), Path(init_folder(args.draft))
    rows = load_distilled(Path(args.distill), target)
    held = [r for r in split_held_out(rows, 256, 0)[0] if len(r["response_ids"]) > 1][:args.rows]
    layers = read_json(folder / "config.json")["dflash_config"]["target_layer_ids"]
    cfg = ArchConfig.from_dict(read_json(target / "config.json"))
    result = {"command": "python " + " ".join(sys.argv), "lscpu": lscpu(),
              "draft": str(folder), "rows": len(held), "block_size": args.block_size}
    for name, activations in (("float32 rows (training's features)", "float32"), ("int8 rows (the runtime's)", "int8")):
        features = FeatureCache(target, layers, budget_bytes=1 << 34)  # in memory: computed by this target
        features.target = TorchTarget(cfg, load_weights(target), target, "cpu", torch.float32, layers, None,
                                      activations, DEFAULT, cpu_flags())
        began = time.process_time()
        result[name] = {"target": features.target.weight_plan,
                        **draft_tau(folder, features, held, 64, args.block_size),
                        "cpu_s": round(time.process_time() - began, 1)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
