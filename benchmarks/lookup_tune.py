"""The context lookup's weight (hetero_sd/decoding/lookup.py), chosen on half of the held-out anchors and read
on the other half: at every anchor of the first `--max-tokens` answer tokens of the held-out rows, the draft's
position-1 distribution and the lookup's guess; a weight w replaces the draft's top token by the guess where
(1 - w) (q(top) - q(guess)) < w. Position 1 right, by source (sharegpt: chat, stdlib: code), per weight and
per lookup order set, on the tune half (even anchors) and the test half (odd anchors).

    python benchmarks/lookup_tune.py --draft cpu-trained --json benchmarks/results/lookup_zen5/tune_e1.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_sd.backends.torch_backend import load_draft  # noqa: E402
from hetero_sd.decoding.lookup import ContextLookup  # noqa: E402
from hetero_sd.loading.sources import resolve_target  # noqa: E402
from hetero_sd.models.config import DraftConfig, read_json  # noqa: E402
from hetero_sd.train.command import init_folder  # noqa: E402
from hetero_sd.train.distill import load_distilled  # noqa: E402
from hetero_sd.train.evaluate import anchor_blocks  # noqa: E402
from hetero_sd.train.trainer import FeatureCache, split_held_out  # noqa: E402

ORDER_SETS = {"3>2": (3, 2), "2": (2,), "3": (3,), "4>3>2": (4, 3, 2), "3>2>1": (3, 2, 1)}
WEIGHTS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)


@torch.no_grad()
def anchors(folder: Path, features, rows: list[dict], max_tokens: int) -> list[dict]:
    cfg = DraftConfig.from_folder(folder)
    draft = load_draft(folder, cfg, features.target, "cpu", torch.float32, cfg.mask_token_id)
    out = []
    for r, ids, a, logits in anchor_blocks(draft, features, rows, max_tokens, 2):
        row = logits[0].float().numpy()
        top = int(row.argmax())
        rec = {"source": r.get("source", "all"), "want": ids[a + 1], "top": top, "guess": {}}
        for name, orders in ORDER_SETS.items():
            g = ContextLookup(ids[:a + 1], orders=orders).guess()
            if g is not None and g != top:
                z = float(np.exp(row - row[top]).sum())
                rec["guess"][name] = [g, (1.0 - float(np.exp(row[g] - row[top]))) / z]
            elif g is not None:
                rec["guess"][name] = [g, 0.0]
        out.append(rec)
    return out


def right(recs: list[dict], orders: str, w: float) -> float:
    hit = 0
    for r in recs:
        g = r["guess"].get(orders)
        tok = g[0] if g is not None and (1.0 - w) * g[1] < w else r["top"]
        hit += tok == r["want"]
    return round(hit / max(len(recs), 1), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="cpu-trained")
    ap.add_argument("--held-out", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--distill", default=str(ROOT / "benchmarks/distill-data/SmolLM2-135M-Instruct"))
    ap.add_argument("--feature-cache", default="/work/train-out/heldout-features")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = resolve_target("default")
    held, _ = split_held_out(load_distilled(Path(args.distill), target), args.held_out, 0)
    held = [r for r in held if len(r["response_ids"]) > 1]
    folder = Path(init_folder(args.draft))
    layer_ids = read_json(folder / "config.json")["dflash_config"]["target_layer_ids"]
    features = FeatureCache(target, layer_ids, budget_bytes=0, disk=Path(args.feature_cache) if args.feature_cache else None)
    began = time.process_time()
    recs = anchors(folder, features, held, args.max_tokens)
    halves = {"tune": recs[::2], "test": recs[1::2]}
    table = {}
    for half, part in halves.items():
        for source in sorted({r["source"] for r in recs}) + ["all"]:
            sel = [r for r in part if source in ("all", r["source"])]
            table.setdefault(half, {})[source] = {o: {str(w): right(sel, o, w) for w in WEIGHTS} for o in ORDER_SETS}
    best = max(((table["tune"]["all"][o][str(w)], o, w) for o in ORDER_SETS for w in WEIGHTS))
    # the controller's states (decoding/controller.py): whether the last 3 tokens occurred before
    by_repeat = {}
    for source in sorted({r["source"] for r in recs}):
        for repeat in (True, False):
            sel = [r for r in recs if r["source"] == source and ("3" in r["guess"]) == repeat]
            by_repeat.setdefault(source, {})["repeat" if repeat else "no repeat"] = {
                "share": round(len(sel) / max(sum(r["source"] == source for r in recs), 1), 3),
                "draft": right(sel, "3>2", 0.0), "with_lookup_0.4": right(sel, "3>2", 0.4)}
    result = {"draft": args.draft, "held_out_rows": len(held), "anchors": len(recs), "max_tokens": args.max_tokens,
              "rule": "replace the draft's top token by the lookup's guess where (1 - w)(q(top) - q(guess)) < w",
              "position_1_right": table, "best_on_tune": {"orders": best[1], "weight": best[2]},
              "test_at_best": {s: table["test"][s][best[1]][str(best[2])] for s in table["test"]},
              "test_without": {s: table["test"][s][best[1]]["0.0"] for s in table["test"]},
              "position_1_right_by_repeat": by_repeat,
              "cpu_s": round(time.process_time() - began, 1), "command": " ".join(sys.argv)}
    print(json.dumps({k: result[k] for k in ("anchors", "best_on_tune", "test_at_best", "test_without",
                                             "position_1_right_by_repeat")}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
