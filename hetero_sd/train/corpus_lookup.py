"""`hetero-sd draft-lookup`: the corpus table of the context lookup (decoding/lookup.py) beside a draft's weights.

From the self-distillation answers the draft was trained on (the held-out rows left out, as draft-vocab and
eval_heldout.py leave them out): every 2-4-token context seen at least twice and its most frequent successor,
written as DIR/lookup_corpus.npz. The runtime finds it there and guesses with it beside the context; a draft
folder without it (every published z-lab draft) decodes exactly as before."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hetero_sd.decoding.lookup import CORPUS_FILE, CORPUS_ORDERS, CorpusTable
from hetero_sd.errors import ConfigError

from .reduce_vocab import DEFAULT_DISTILL, draft_folder


def build(stores: list[Path], target: str, held_out: int, min_count: int = 2) -> tuple[CorpusTable, dict]:
    """The table of the training rows of every store (each store's own held-out rows left out, as train-draft
    and eval_heldout.py leave them out)."""
    from hetero_sd.loading.sources import resolve_target

    from .distill import load_distilled
    from .trainer import split_held_out

    folder, train, held = resolve_target(target), [], 0
    for store in stores:
        rows = load_distilled(store, folder)  # the prompts as the target saw them (its template)
        if not rows:
            raise ConfigError(f"{store} holds no answers", "make them with: hetero-sd train-draft --distill DIR --generate-only")
        out = {r["key"] for r in split_held_out(rows, held_out, 0)[0]}
        train += [r for r in rows if r["key"] not in out]
        held += len(out)
    table = CorpusTable.build(((r["prompt_ids"], r["response_ids"]) for r in train), CORPUS_ORDERS, min_count)
    return table, {"distill": [str(s) for s in stores], "rows": len(train), "held_out_rows_excluded": held,
                   "answer_tokens": sum(len(r["response_ids"]) for r in train), "min_count": min_count,
                   "contexts": {str(k): len(t[0]) for k, t in table.tables.items()}}


def command(args: argparse.Namespace) -> dict:
    if args.held_out < 0 or args.min_count < 1:
        raise ConfigError(f"--held-out {args.held_out} / --min-count {args.min_count}", "give --held-out >= 0 and --min-count >= 1")
    out = Path(args.out) if args.out else draft_folder(args.draft)
    if not (out / "config.json").is_file():
        raise ConfigError(f"{out}: not a draft folder (no config.json)", "give --out the draft's folder")
    began = time.process_time()
    table, report = build([Path(d) for d in args.distill or [DEFAULT_DISTILL]], args.target, args.held_out, args.min_count)
    table.save(out / CORPUS_FILE)
    report |= {"file": CORPUS_FILE, "bytes": (out / CORPUS_FILE).stat().st_size, "cpu_s": round(time.process_time() - began, 1)}
    (out / "lookup_corpus.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


def add_parser(sub) -> None:
    p = sub.add_parser("draft-lookup", help="the context lookup's corpus table (lookup_corpus.npz) beside a draft")
    p.add_argument("--draft", required=True, help="the draft folder, or a shipped name (cpu-trained)")
    p.add_argument("--out", default=None, help="the folder to write into (default: the draft's own)")
    p.add_argument("--distill", action="append", default=None,
                   help="self-distillation shards whose answers give the contexts (train-draft --distill; repeatable; "
                        "default: the default target's first store)")
    p.add_argument("--target", default="default", help="the target the answers came from (its chat template)")
    p.add_argument("--held-out", type=int, default=256,
                   help="rows left out: the N smallest key hashes (eval_heldout.py's held-out rows)")
    p.add_argument("--min-count", type=int, default=2, help="contexts seen fewer times are left out")
