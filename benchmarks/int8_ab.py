"""Issue 26: the default target's float32 numerics vs `--dtype int8` (llama.cpp's: int8 rows x GGUF blocks) in ONE
process, interleaved (the machine is shared: only a same-process, same-minute comparison means anything). Each
round runs the cost probe of `hetero-sd bench --costs` on each variant in turn (decode step, verify of k, draft
of b with the shipped draft); medians over rounds, in ms and in decode-step units, and int8/float32 ratios.

    python benchmarks/int8_ab.py --threads 1 --rounds 3 --ks 1,2,4,8,16,32,64 --json benchmarks/results/int8_ab_avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch

from hetero_sd.bench.runner import machine
from hetero_sd.decoding.costs import measure_costs
from hetero_sd.runtime import load


def lscpu() -> dict:
    """The CPU's model name and the flags that decide which kernel runs."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    notable = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8"]
    return {"model": fields.get("Model name", "?").strip(), "cpus": fields.get("CPU(s)", "?").strip(),
            "flags": {f: f in flags for f in notable}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtypes", default="float32,int8")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = tuple(int(k) for k in args.ks.split(","))
    variants = {d: load("default", args.draft, dtype=d, cpu_threads=args.threads) for d in args.dtypes.split(",")}
    runs = {d: [] for d in variants}
    for r in range(args.rounds):
        for name, rt in variants.items():
            c = measure_costs(rt.target, rt.draft, ks=ks, blocks=(16,))
            runs[name].append(c)
            print(f"round {r} {name:8s} decode {c.decode_s * 1e3:6.2f} ms  " + "  ".join(
                f"v{k} {c.verify_s[k] / c.decode_s:.2f}" for k in ks), flush=True)
    doc = {"command": " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv), "machine": machine(), "lscpu": lscpu(),
           "torch_threads": torch.get_num_threads(), "rounds": args.rounds,
           "load_note": "shared 2-core VM: other helpers' jobs and a nice-19 training run were running; indicative",
           "variants": {}}
    for name, cs in runs.items():
        med = lambda f: statistics.median(f(c) for c in cs)  # noqa: E731
        decode = med(lambda c: c.decode_s)
        verify = {k: med(lambda c, k=k: c.verify_s[k]) for k in ks}
        draft = {b: med(lambda c, b=b: c.draft_s[b]) for b in cs[0].draft_s}
        doc["variants"][name] = {
            "target_weights": variants[name].info.get("target_weights"),
            "decode_ms": round(decode * 1e3, 3),
            "verify_ms": {k: round(v * 1e3, 3) for k, v in verify.items()},
            "verify_in_decode_steps": {k: round(v / decode, 3) for k, v in verify.items()},
            "draft_in_decode_steps": {b: round(v / decode, 3) for b, v in draft.items()},
            "rounds_decode_ms": [round(c.decode_s * 1e3, 3) for c in cs]}
    if {"float32", "int8"} <= set(runs):
        f, i = doc["variants"]["float32"], doc["variants"]["int8"]
        doc["int8_over_float32_ms"] = {"decode": round(i["decode_ms"] / f["decode_ms"], 3),
                                       **{f"verify-{k}": round(i["verify_ms"][k] / f["verify_ms"][k], 3) for k in ks}}
    print(json.dumps({k: v for k, v in doc.items() if k not in ("machine",)}, indent=1))
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
