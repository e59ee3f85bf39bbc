"""Why a draft block costs ~3x more inside the decoding loop than `bench --costs` says: the draft's weights
are fetched from memory again after every verify. Times the default draft's block (sizes 2 and 8) warm
(back to back, as the cost probe runs it), right after a target verify of 2 rows (as the loop runs it), and
right after touching a 64 MB buffer (caches flushed, no target involved); and the target's head (the GGUF's
Q8_0 head, 49152 rows) on 1-8 rows right after a forward: whether fewer verify rows through the head would
save anything. Medians of --reps calls; the default target and draft, a chat prompt as context.

    python benchmarks/draft_cold.py [--reps 40] [--threads 2] [--draft DIR] [--json benchmarks/results/draft_cold_zen5.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hetero_sd  # noqa: E402
from hetero_sd.bench.runner import machine  # noqa: E402
from hetero_sd.train.distill import chat_ids  # noqa: E402
from timing import options  # noqa: E402

OPTIONS = {"--reps": (int, 40), "--threads": (int, 2), "--json": (str, None), "--draft": (str, "default")}


def ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def timed(f, before=None, reps: int = 40) -> float:
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        began = time.perf_counter()
        f()
        out.append(time.perf_counter() - began)
    return ms(out)


def main() -> None:
    args = options(OPTIONS)
    torch.set_num_threads(args.threads)
    rt = hetero_sd.load("default", args.draft, block_size=8)
    target, draft = rt.target, rt.draft
    out = target.forward(chat_ids(rt.tokenizer, "Write a short story about a robot who learns to paint."))
    draft.add_context(out.features)
    anchor, length = int(out.logits[-1].argmax()), target.length
    flush = torch.empty(64 << 20, dtype=torch.uint8)

    def verify_2():
        target.forward([anchor, 5], features=True)
        target.crop(length)

    result = {"machine": machine(), "command": "python " + " ".join(sys.argv), "reps": args.reps,
              "draft_weights_mb": round(draft.weights().read_bytes / 1e6, 1) if draft.weights().read_bytes else None,
              "draft_notes": [n for n in rt.notes if n.startswith("draft")], "draft_block_ms": {}, "head_ms": {}}
    for size in (2, 8):
        block = lambda size=size: draft.propose(anchor, size=size)  # noqa: E731
        block()
        result["draft_block_ms"][size] = {"warm": timed(block, reps=args.reps),
                                          "after_verify_2": timed(block, verify_2, args.reps),
                                          "after_64mb_flush": timed(block, lambda: flush.fill_(1), args.reps)}
    result["verify_2_ms"] = timed(verify_2, reps=args.reps)
    x = torch.randn(8, rt.target.config.hidden_size)
    for rows in (1, 2, 4, 8):
        result["head_ms"][rows] = timed(lambda rows=rows: target.mm_head(x[:rows]), verify_2, args.reps)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
