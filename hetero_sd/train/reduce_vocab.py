"""`hetero-sd draft-vocab`: a copy of a DFlash draft whose head scores only the K target tokens that are most
frequent in the target's own answers (hetero_sd/models/draft_vocab.py: the format, and why it stays lossless).

Frequencies come from the self-distillation shards' answer tokens (`train-draft --distill`), never from an
evaluation set, and leave out the held-out rows (the N smallest key hashes, as trainer.split_held_out and
benchmarks/eval_heldout.py choose them), so the held-out evaluation of the reduced draft stays fair. The
stop ids of the shards' manifest are always kept (a draft that cannot propose EOS cannot end a block on it).
The draft's layers are copied unchanged: only the ids its head scores are added."""

from __future__ import annotations

import argparse
import json
import shutil
from collections import Counter
from pathlib import Path

import torch

from hetero_sd.errors import ConfigError, OutputPathError
from hetero_sd.models import draft_vocab
from hetero_sd.models.config import DraftConfig
from hetero_sd.models.draft_format import read_config, read_tensors, write_folder

DEFAULT_DISTILL = Path(__file__).resolve().parents[2] / "benchmarks" / "distill-data" / "SmolLM2-135M-Instruct"


def answer_counts(distill: Path, held_out: int) -> tuple[Counter, Counter, dict]:
    """Token counts of the training answers and of the held-out answers, and the shards' manifest."""
    from .distill import ShardStore
    from .trainer import split_held_out

    store = ShardStore.existing(distill)
    rows = list(store.read())
    if not rows:
        raise ConfigError(f"{distill} holds no answers", "make them with: hetero-sd train-draft --distill DIR --generate-only")
    held = {r["key"] for r in split_held_out([dict(r, index=i) for i, r in enumerate(rows)], held_out, 0)[0]}
    train, test = Counter(), Counter()
    for r in rows:
        (test if r["key"] in held else train).update(r["response_ids"])
    return train, test, store.manifest


def choose(counts: Counter, k: int, keep: list[int], vocab_size: int) -> list[int]:
    """The k most frequent ids (ties by id, so the choice is reproducible), `keep` always among them."""
    keep = sorted({t for t in keep if 0 <= t < vocab_size})
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in keep]
    return sorted(keep + ranked[:max(0, k - len(keep))])


def coverage(counts: Counter, ids: list[int]) -> float:
    total = sum(counts.values())
    return sum(counts[t] for t in ids) / total if total else 0.0


def reduce_draft(src: Path, out: Path, distill: Path, k: int, held_out: int = 256) -> dict:
    """Write the reduced copy of the draft in `src` to `out`; returns the report (also out/draft_vocab.json)."""
    raw = read_config(src)  # either layout (models/draft_format.py)
    cfg = DraftConfig.from_dict(raw, str(src / "config.json"))
    vocab = cfg.arch.vocab_size
    if not 1 <= k <= vocab:
        raise ConfigError(f"--k {k} is not within the draft's vocabulary (1..{vocab})", "pick K in that range, e.g. 8192")
    tensors = read_tensors(src, cfg)
    train, test, manifest = answer_counts(distill, held_out)
    if manifest.get("vocab_size") not in (None, vocab):
        raise ConfigError(f"{distill} holds answers of a target with vocabulary {manifest['vocab_size']}, the draft's "
                          f"is {vocab}", "give --distill the shards of this draft's target")
    ids = choose(train, k, list(manifest.get("stop_ids", [])), vocab)
    if out.exists() and any(out.iterdir()):
        raise OutputPathError(f"--out {out} exists and is not empty", "give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t for n, t in tensors.items() if n != draft_vocab.TENSOR}
    tensors[draft_vocab.TENSOR] = torch.tensor(ids, dtype=torch.int64)
    raw.setdefault("dflash_config", {})[draft_vocab.KEY] = len(ids)
    raw.pop(draft_vocab.KEY, None)
    write_folder(out, raw, tensors)  # z-lab's two files unchanged but for the head's ids, which go beside them
    for extra in ("training.json",):  # what the draft's own folder says about its training
        if (src / extra).is_file():
            shutil.copy(src / extra, out / extra)
    report = {"source_draft": str(src), "k": len(ids), "vocab_size": vocab, "distill": str(distill),
              "answers_tokens_counted": sum(train.values()), "distinct_answer_tokens": len(train),
              "held_out_rows_excluded": held_out, "kept_stop_ids": manifest.get("stop_ids", []),
              "coverage_train_answers": round(coverage(train, ids), 4),
              "coverage_held_out_answers": round(coverage(test, ids), 4)}
    (out / "draft_vocab.json").write_text(json.dumps(report, indent=2) + "\n")
    DraftConfig.from_folder(out)  # what was written reads back as a valid reduced draft
    read_tensors(out, DraftConfig.from_folder(out))
    return report


def add_parser(sub) -> None:
    p = sub.add_parser("draft-vocab", help="a copy of a DFlash draft whose head scores only the K most frequent tokens")
    p.add_argument("--draft", required=True, help="the draft folder, or a shipped name (cpu-trained)")
    p.add_argument("--k", type=int, required=True, help="how many target tokens the head scores (e.g. 8192)")
    p.add_argument("--out", required=True, help="a new folder for the reduced draft")
    p.add_argument("--distill", default=str(DEFAULT_DISTILL),
                   help="self-distillation shards whose answers give the frequencies (train-draft --distill)")
    p.add_argument("--held-out", type=int, default=256,
                   help="rows left out of the counts: the N smallest key hashes (eval_heldout.py's held-out rows)")


def draft_folder(name: str) -> Path:
    from hetero_sd.loading.loader import SHIPPED_DRAFTS, shipped

    folder = Path(str(shipped(name))) if name in SHIPPED_DRAFTS and shipped(name) else Path(name)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--draft {name}: no draft folder (config.json) there",
                          "give a DFlash draft folder or a shipped draft name such as cpu-trained")
    return folder


def command(args: argparse.Namespace) -> dict:
    if args.held_out < 0:
        raise ConfigError(f"--held-out {args.held_out} is negative", "give 0 or more rows")
    src = draft_folder(args.draft)
    report = reduce_draft(src, Path(args.out), Path(args.distill), args.k, args.held_out)
    print(json.dumps(report, indent=2))
    return report
