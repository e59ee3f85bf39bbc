"""Issue 26: the int8 target with its K/V cache of each kind in --kinds (q8_0: K as q8_0 blocks and V float16,
llama.cpp's -ctk q8_0, the default where the CPU has AVX512-VNNI; float16: llama.cpp's default, ours elsewhere;
float32), in ONE process, interleaved: every
round times a decode step and verifies of k tokens on every target, each on a context of --contexts tokens, so
that load from other jobs falls on all alike. Medians over rounds of each call; the ratios are each kind's time
over the first kind's (below 1: faster).

    python benchmarks/kv_cache_ab.py --contexts 200,512,1024 --json benchmarks/results/kv_cache_ab_avx2.json
    python benchmarks/kv_cache_ab.py --kinds float16,q8_0 --ks 1,8,16 --contexts 512,1500 --prefill 500
--prefill N also times a prompt of N tokens into an empty cache (the prompt's attention is the same kernel).
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
from hetero_sd.cli.policy import policy_from_env
from hetero_sd.errors import ConfigError
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
    ap.add_argument("--kinds", default="float16,float32")
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-note", default="quiet: the one background job paused (SIGSTOP)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    try:  # each kind as HETERO_SD_KV names it
        policies = {name: policy_from_env({"HETERO_SD_KV": name}) for name in kinds}
    except ConfigError as e:
        raise SystemExit(f"--kinds: {e}")
    targets = {name: hetero_sd.load("default", None, policy=policies[name]).target for name in kinds}
    k_dtypes = {"float16": torch.float16, "float32": torch.float32, "q8_0": torch.uint8}
    for name, t in targets.items():  # the kind asked for, not a fallback
        if t.cache.k[0].dtype != k_dtypes[name]:
            raise SystemExit(f"{name}: the target's K cache is {t.cache.k[0].dtype} here ({'; '.join(t.notes)})")
    vocab = targets[kinds[0]].config.vocab_size
    ks = [int(k) for k in args.ks.split(",")]
    out = {"what": f"int8 default target, K/V cache {' vs '.join(kinds)}, interleaved rounds, median ms",
           "command": " ".join(["python"] + sys.argv), "lscpu": lscpu(), "threads": args.threads,
           "load_note": args.load_note, "ms": {}, f"over_{kinds[0]}": {}}
    if args.prefill:
        samples = {name: [] for name in targets}
        for _ in range(args.rounds):
            for name, t in targets.items():
                t.crop(0)
                samples[name].append(timed(t, 0, fill_ids(args.prefill, vocab), 1))
        ms = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
        key = f"prefill {args.prefill}"
        out["ms"][key] = {n: round(v, 3) for n, v in ms.items()}
        out[f"over_{kinds[0]}"][key] = {n: round(v / ms[kinds[0]], 3) for n, v in ms.items() if n != kinds[0]}
        print(f"{key:28s} " + "  ".join(f"{n} {v:7.2f} ms" for n, v in ms.items()), flush=True)
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
            ms = {n: statistics.median(samples[(n, k)]) * 1e3 for n in kinds}
            key = f"context {context}, {'decode' if k == 1 else f'verify {k}'}"
            out["ms"][key] = {n: round(v, 3) for n, v in ms.items()}
            out[f"over_{kinds[0]}"][key] = {n: round(v / ms[kinds[0]], 3) for n, v in ms.items() if n != kinds[0]}
            print(f"{key:28s} " + "  ".join(f"{n} {v:7.2f} ms" for n, v in ms.items()) + "  ("
                  + ", ".join(f"{n} {v / ms[kinds[0]]:.3f}" for n, v in ms.items() if n != kinds[0]) + ")", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
