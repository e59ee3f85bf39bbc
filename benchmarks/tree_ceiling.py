"""Would a token tree pay here? Medusa-style trees over a DFlash block's per-position logits, on the held-out rows.

A DFlash block gives, at every position, the draft's distribution given the anchor and masks (not given the
token it proposed before it), so the candidates of position 2 are the same under every candidate of position
1, as with Medusa's heads. A tree of n nodes is a prefix-closed set of rank tuples (r1, ..., rd): node
(0, 1) is "position 1's top token, then position 2's second". At T=0 a block accepts the deepest node whose
ranks equal the ranks of the target's own continuation, plus the bonus token; the target verifies the tree
in one forward of n + 1 rows (the anchor and every node, each seeing its ancestors). Since a node is hit only
if its parent is, the best tree of n nodes for a set of anchors is its n most frequent rank prefixes.

This script takes the ranks of the target's continuation in the shipped draft's logits at every anchor of
the held-out rows (those the long run never trained on; the runtime's draft as loaded, blocks of --block),
fits the best tree of each size on the even rows and reads it on the odd ones, next to the single path
(the runtime's blocks). It then prices each with the verify costs measured here (`measure_costs`, at
--context tokens: verify of n + 1 rows, in decode steps) plus --overhead decode steps per block step (the
draft's block, its catch-up and the loop's bookkeeping: `loop_costs.py` measured ~0.28 on the 2-core Zen 5)
and reports tokens per decode-step of cost. No tree verification exists in the runtime: this says whether
one is worth building on this CPU.

    python benchmarks/tree_ceiling.py [--draft cpu-trained] [--feature-cache /work/train-out/heldout-features]
                                      [--overhead 0.28] [--json benchmarks/results/tree_ceiling_zen5.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetero_sd  # noqa: E402
from hetero_sd.backends.torch_backend import load_draft  # noqa: E402
from hetero_sd.bench.runner import machine  # noqa: E402
from hetero_sd.decoding.controller import interpolate  # noqa: E402
from hetero_sd.decoding.costs import measure_costs  # noqa: E402
from hetero_sd.loading.sources import resolve_target  # noqa: E402
from hetero_sd.models.config import DraftConfig, read_json  # noqa: E402
from hetero_sd.train.command import init_folder  # noqa: E402
from hetero_sd.train.distill import load_distilled  # noqa: E402
from hetero_sd.train.evaluate import anchor_blocks  # noqa: E402
from hetero_sd.train.trainer import FeatureCache, split_held_out  # noqa: E402

CAP = 16  # ranks at or past this are misses (a tree never holds such a node)
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15)  # up to a verify of 16 rows, the largest the probe times


def anchor_ranks(folder: Path, features, rows: list[dict], block: int, max_tokens: int) -> list[dict]:
    """Per anchor of every row (the first max_tokens answer tokens): the ranks of the answer's next block - 1
    tokens in the draft's logits at those positions (CAP: past the cap or outside a reduced head)."""
    cfg = DraftConfig.from_folder(folder)
    cfg.block_size = max(block, cfg.block_size)
    draft = load_draft(folder, cfg, features.target, "cpu", torch.float32, cfg.mask_token_id)
    out = []
    for r, ids, a, logits in anchor_blocks(draft, features, rows, max_tokens, block):
        end = min(len(ids), len(r["prompt_ids"]) + max_tokens)
        want = ids[a + 1:min(a + block, end)]
        ranks = [min(int((logits[i] > logits[i, t]).sum()), CAP) for i, t in enumerate(want)]
        out.append({"source": r.get("source", "all"), "row": r["index"], "ranks": ranks})
    return out


def prefixes(ranks: list[int]) -> list[tuple]:
    out = []
    for d in range(len(ranks)):
        if ranks[d] >= CAP:
            break
        out.append(tuple(ranks[:d + 1]))
    return out


def best_tree(anchors: list[dict], n: int) -> set:
    counts = Counter(p for a in anchors for p in prefixes(a["ranks"]))
    tree: set = set()
    for node, _ in sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0])):
        if len(tree) >= n:
            break
        if len(node) == 1 or node[:-1] in tree:
            tree.add(node)
    return tree


def tau(anchors: list[dict], tree: set) -> float:
    total = 0
    for a in anchors:
        depth = 0
        for p in prefixes(a["ranks"]):
            if p not in tree:
                break
            depth = len(p)
        total += depth + 1
    return total / max(len(anchors), 1)


def verify_steps(costs, rows: int) -> float:
    """A verify of `rows` rows in decode steps, linear between the probed sizes (the controller's own cost model)."""
    return interpolate(costs.verify_s, rows) / costs.decode_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="cpu-trained")
    ap.add_argument("--feature-cache", default="/work/train-out/heldout-features")
    ap.add_argument("--distill", default=str(ROOT / "benchmarks/distill-data/SmolLM2-135M-Instruct"))
    ap.add_argument("--held-out", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--overhead", type=float, default=0.28, help="decode steps a block step pays beside its verify")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    began = time.time()
    target = resolve_target("default")
    held, _ = split_held_out(load_distilled(Path(args.distill), target), args.held_out, 0)
    held = [r for r in held if len(r["response_ids"]) > 1]
    folder = Path(init_folder(args.draft))
    layers = read_json(folder / "config.json")["dflash_config"]["target_layer_ids"]
    features = FeatureCache(target, layers, budget_bytes=0,
                            disk=Path(args.feature_cache) if args.feature_cache else None)
    anchors = anchor_ranks(folder, features, held, args.block, args.max_tokens)
    rt = hetero_sd.load("default", args.draft)
    costs = measure_costs(rt.target, None, context=args.context, ks=(1, 2, 4, 8, 16), repeats=10)
    result = {"machine": machine(), "command": " ".join(sys.argv), "draft": str(folder), "block": args.block,
              "held_out_rows": len(held), "anchors": len(anchors), "overhead_decode_steps": args.overhead,
              "decode_ms": round(costs.decode_s * 1e3, 3),
              "verify_decode_steps": {k: round(v / costs.decode_s, 3) for k, v in costs.verify_s.items()},
              "sources": {}}
    for source in sorted({a["source"] for a in anchors}):
        mine = [a for a in anchors if a["source"] == source]
        fit, read = [a for a in mine if a["row"] % 2 == 0], [a for a in mine if a["row"] % 2 == 1]
        rows = []
        for n in SIZES:
            path = {tuple([0] * d) for d in range(1, min(n, args.block - 1) + 1)}
            tree = best_tree(fit, n)
            cost_path = verify_steps(costs, len(path) + 1) + args.overhead
            cost_tree = verify_steps(costs, n + 1) + args.overhead
            rows.append({"nodes": n, "path_tau": round(tau(read, path), 4), "tree_tau": round(tau(read, tree), 4),
                         "path_tokens_per_cost": round(tau(read, path) / cost_path, 4),
                         "tree_tokens_per_cost": round(tau(read, tree) / cost_tree, 4),
                         "tree": sorted(map(list, tree), key=len) if n <= 8 else None})
        best = {kind: max(rows, key=lambda r: r[f"{kind}_tokens_per_cost"]) for kind in ("path", "tree")}
        result["sources"][source] = {
            "anchors_fit": len(fit), "anchors_read": len(read), "sizes": rows,
            "best_path": {"nodes": best["path"]["nodes"], "tokens_per_cost": best["path"]["path_tokens_per_cost"]},
            "best_tree": {"nodes": best["tree"]["nodes"], "tokens_per_cost": best["tree"]["tree_tokens_per_cost"]},
            "tree_over_path": round(best["tree"]["tree_tokens_per_cost"] / best["path"]["path_tokens_per_cost"], 4)}
        print(source, json.dumps(result["sources"][source]["best_path"]), json.dumps(result["sources"][source]["best_tree"]),
              "tree/path", result["sources"][source]["tree_over_path"])
        for r in rows:
            print(f"  nodes {r['nodes']:2d}: path tau {r['path_tau']:.3f} ({r['path_tokens_per_cost']:.3f}/step cost)"
                  f"  tree tau {r['tree_tau']:.3f} ({r['tree_tokens_per_cost']:.3f})")
    result["wall_s"] = round(time.time() - began, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
