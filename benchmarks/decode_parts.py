"""Where a decode step of the default target goes, by wall clock: every GGUF-block product and every fused
op is timed around its call (the instrumentation adds ~5%), the rest is Python and torch around them.
One process, 512 tokens of context, `--steps` decode steps after 30 of warm-up; `--rows 16` times a
verify of 16 tokens instead of a decode step.

    python benchmarks/decode_parts.py [--dtype int8] [--rows 1] [--steps 300] [--walk ops] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.backends.torch_backend import fused, quant
from hetero_sd.bench.runner import machine
from hetero_sd.decoding.costs import fill_ids


def timed_calls(acc: collections.Counter, target) -> None:
    """Wrap the target's fused kernels and Quantized.__call__ so that each call's time is added up."""
    real = target.ops.k if target.fused else fused.extension()

    class Timed:
        def __getattr__(self, name):
            f = getattr(real, name)
            if not callable(f):
                return f

            def call(*args):
                began = time.perf_counter()
                out = f(*args)
                acc[name] += time.perf_counter() - began
                return out
            return call
    timed = Timed()
    if target.fused:
        target.ops.k = timed  # (fused.FusedLayerOps calls its kernels through .k)
    product = quant.Quantized.__call__

    def call(self, x):
        began = time.perf_counter()
        out = product(self, x)
        acc[f"{self.kind} products"] += time.perf_counter() - began
        return out
    quant.Quantized.__call__ = call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rows", type=int, default=1, help="tokens per forward: 1 (decode) or a verify's block")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--walk", choices=["stack", "ops"], default="stack",
                    help="stack: the one-call layer walk (timed as one 'layers' op); ops: op by op, each timed")
    ap.add_argument("--json")
    args = ap.parse_args()
    target = hetero_sd.load("default", None, dtype=args.dtype, policy=LoadPolicy(stack=args.walk == "stack")).target
    acc = collections.Counter()
    timed_calls(acc, target)
    target.crop(0)
    target.forward(fill_ids(512, target.config.vocab_size), last_only=True)

    def steps(n: int) -> float:
        began = time.perf_counter()
        for _ in range(n):
            target.crop(512)
            target.forward([5] * args.rows)
        return (time.perf_counter() - began) / n

    steps(30)
    acc.clear()
    step = steps(args.steps)
    parts = {k: round(v / args.steps * 1e3, 3) for k, v in acc.most_common()}
    parts["rest (Python, torch)"] = round(step * 1e3 - sum(parts.values()), 3)
    out = {"machine": machine(), "dtype": args.dtype or "float32", "rows": args.rows, "walk": args.walk, "step_ms": round(step * 1e3, 3), "parts_ms": parts}
    print(json.dumps(out["parts_ms"]), f"step {out['step_ms']} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
