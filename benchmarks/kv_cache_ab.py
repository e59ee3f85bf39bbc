"""Issue 26: the int8 target with its K/V cache in float16 (llama.cpp's, the default) vs float32, in ONE
process, interleaved: every round times a decode step and verifies of k tokens on both targets, each on a
context of --contexts tokens, so that load from other jobs falls on both alike. Medians over rounds of each
call; the ratio is float16 / float32 (below 1: the float16 cache is faster).

    python benchmarks/kv_cache_ab.py --contexts 200,512,1024 --json benchmarks/results/kv_cache_ab_avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.decoding.costs import fill_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402


def timed(target, base: int, ids: list[int], repeats: int) -> float:
    """Median seconds of `repeats` forwards of `ids` at position `base` (cropped back after each)."""
    out = []
    for _ in range(repeats):
        began = time.perf_counter()
        target.forward(ids, features=len(ids) > 1)
        out.append(time.perf_counter() - began)
        target.crop(base)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="200,512,1024")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-note", default="quiet: the one background job paused (SIGSTOP)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    targets = {name: hetero_sd.load("default", None, policy=LoadPolicy(kv_f16=f16)).target
               for name, f16 in (("float16", True), ("float32", False))}
    assert targets["float16"].cache.k[0].dtype == torch.float16 and targets["float32"].cache.k[0].dtype == torch.float32
    vocab = targets["float16"].config.vocab_size
    ks = [int(k) for k in args.ks.split(",")]
    out = {"what": "int8 default target, K/V cache float16 vs float32, interleaved rounds, median ms",
           "command": " ".join(["python"] + sys.argv), "lscpu": lscpu(), "threads": args.threads,
           "load_note": args.load_note, "ms": {}, "float16_over_float32": {}}
    for context in (int(c) for c in args.contexts.split(",")):
        for t in targets.values():
            t.crop(0)
            t.forward(fill_ids(context, vocab), features=False, last_only=True)
        samples = {(name, k): [] for name in targets for k in ks}
        for _ in range(args.rounds):
            for k in ks:
                for name, t in targets.items():
                    samples[(name, k)].append(timed(t, context, fill_ids(k, vocab), args.repeats))
        for k in ks:
            f16, f32 = (statistics.median(samples[(n, k)]) * 1e3 for n in ("float16", "float32"))
            key = f"context {context}, {'decode' if k == 1 else f'verify {k}'}"
            out["ms"][key] = {"float16": round(f16, 3), "float32": round(f32, 3)}
            out["float16_over_float32"][key] = round(f16 / f32, 3)
            print(f"{key:28s} float16 {f16:7.2f} ms  float32 {f32:7.2f} ms  ({f16 / f32:.3f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
