"""Acceptance with a reduced draft vocabulary vs the full head, by simulated greedy decoding on the held-out
rows of the shards (hetero_sd/train/evaluate.py, as benchmarks/eval_heldout.py), all heads in one pass.

A reduced head's greedy proposal is the argmax of the full head's logits over its K ids (the int8 head rows
are computed per column: the K columns are the full head's, bitwise; the script checks this on the first
rows against the reduced drafts themselves), so one draft pass per anchor serves every K; each K replays
its own anchors (a block's length decides the next anchor), the draft's logits memoised per anchor.

    python benchmarks/draft_vocab_tau.py --reduced /tmp/dv4k /tmp/dv8k /tmp/dv16k \
        --json benchmarks/results/draft_vocab_tau.json"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_sd.backends.torch_backend import load_draft  # noqa: E402
from hetero_sd.loading.sources import resolve_target  # noqa: E402
from hetero_sd.models.config import DraftConfig, read_json  # noqa: E402
from hetero_sd.train.distill import load_distilled  # noqa: E402
from hetero_sd.train.evaluate import replay, summarise  # noqa: E402
from hetero_sd.train.reduce_vocab import draft_folder  # noqa: E402
from hetero_sd.train.trainer import FeatureCache, split_held_out  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="cpu-trained")
    ap.add_argument("--reduced", nargs="+", required=True)
    ap.add_argument("--held-out", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=0, help="only the first N held-out rows (0: all)")
    ap.add_argument("--check-rows", type=int, default=4, help="rows on which each reduced draft is run itself")
    ap.add_argument("--distill", default=str(ROOT / "benchmarks/distill-data/SmolLM2-135M-Instruct"))
    ap.add_argument("--feature-cache", default="/work/train-out/features")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu0, target = time.process_time(), resolve_target("default")
    rows = load_distilled(Path(args.distill), target)
    held, _ = split_held_out(rows, args.held_out, 0)
    held = [r for r in held if len(r["response_ids"]) > 1]
    held = held[:args.rows] if args.rows else held
    folder = draft_folder(args.draft)
    raw = read_json(folder / "config.json")
    features = FeatureCache(target, raw["dflash_config"]["target_layer_ids"], budget_bytes=0,
                            disk=Path(args.feature_cache) if args.feature_cache else None)
    cfg = DraftConfig.from_folder(folder)
    draft = load_draft(folder, cfg, features.target, "cpu", torch.float32, cfg.mask_token_id)
    heads = {"full": None} | {Path(f).name: load_file(str(Path(f) / "model.safetensors"))["draft_vocab"]
                              for f in args.reduced}
    reduced_drafts = {Path(f).name: load_draft(Path(f), DraftConfig.from_folder(Path(f)), features.target, "cpu",
                                               torch.float32, cfg.mask_token_id) for f in args.reduced}
    per_head = {name: [] for name in heads}
    check = {name: [0, 0] for name in reduced_drafts}
    for n, r in enumerate(held):
        if n % 16 == 0:
            print(f"row {n}/{len(held)}, {time.process_time() - cpu0:.0f} CPU s", file=sys.stderr, flush=True)
        ids, p = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])
        feats = features(r["index"], ids, r.get("key"))
        memo: dict[int, torch.Tensor] = {}
        draft.crop(0)  # this row's context only

        def logits_at(a: int) -> torch.Tensor:
            if a not in memo:
                if draft.context_length > a:
                    draft.crop(a)
                if draft.context_length < a:
                    draft.add_context(feats[draft.context_length:a])
                memo[a] = draft.propose(ids[a])
            return memo[a]

        for name, keep in heads.items():
            def guess(a: int, keep=keep) -> list[int]:
                logits = logits_at(a)
                return (logits.argmax(-1) if keep is None else keep[logits[:, keep].argmax(-1)]).tolist()
            per_head[name].append((r.get("source", "all"), replay(ids, p, cfg.block_size, guess, args.max_tokens)))
        if n < args.check_rows:  # the reduced drafts themselves, at this row's first anchors
            for name, d in reduced_drafts.items():
                d.crop(0)
                for a in sorted(memo)[:4]:
                    if d.context_length > a:
                        d.crop(a)
                    d.add_context(feats[d.context_length:a])
                    got = d.propose(ids[a]).argmax(-1)
                    keep = heads[name]
                    check[name][0] += int((got == keep[memo[a][:, keep].argmax(-1)]).sum())
                    check[name][1] += got.numel()
    if features.disk is not None:
        features.disk.flush()
    result = {"what": "simulated greedy decoding tau on the shards' held-out rows (never counted for the K ids, "
                      "never trained on), block 16, first 64 answer tokens per row, full vs reduced draft head",
              "draft": str(folder), "held_out_rows": len(held), "max_tokens": args.max_tokens,
              "cpu": "2-core AMD EPYC (AVX2 only), shared with other jobs (load average "
                     f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end); tau does not depend on the load",
              "tau": {name: summarise(v) for name, v in per_head.items()},
              "reduced_draft_agrees_with_the_restricted_full_head": {k: f"{a}/{b}" for k, (a, b) in check.items()},
              "cpu_s": round(time.process_time() - cpu0, 1)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
