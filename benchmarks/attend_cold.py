"""Issue 26: what the fused attention op costs warm and cold (SmolLM2-135M's shape: 9 query heads, 3 K/V heads,
head dim 64, a float16 K cache tiled by 16 positions), so that the gap between the op alone (attend_rows.py) and
the op inside a forward (decode_parts.py --walk ops) can be split into its K/V bytes and the rest of its state.

Per round, for 1 and 8 rows over --context keys: warm (the same call twice); cold (after writing a 128 MB buffer);
cold with the K/V read back first; cold with another layer's call first (code, scratch, threads warm again); both;
and 30 layers' caches in turn (a real step's working set). Medians over --rounds, microseconds a call.

    python benchmarks/attend_cold.py [--context 512] [--rounds 30] [--json benchmarks/results/attend_cold_zen5_probe.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hetero_sd.backends.torch_backend import fused

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402
from timing import options  # noqa: E402

OPTIONS = {"--context": (int, 512), "--rounds": (int, 30), "--threads": (int, 2), "--json": (str, None)}
LAYERS = 30


def main() -> None:
    args = options(OPTIONS)
    torch.set_num_threads(args.threads)
    k = fused.extension()
    g = torch.Generator().manual_seed(0)
    ctx, cap = args.context, args.context + 64
    tiled = lambda kc: kc.view(1, 3, cap // 16, 16, 64).transpose(-1, -2).contiguous().view(1, 3, cap, 64)  # noqa: E731
    ks = [tiled(torch.randn(1, 3, cap, 64, generator=g).half()) for _ in range(LAYERS)]
    vs = [torch.randn(1, 3, cap, 64, generator=g).half() for _ in range(LAYERS)]
    flush = torch.empty(128 * 2**20 // 4)

    def touch(t: torch.Tensor) -> float:  # every cache line of the keys/values in use
        return float(t[0, :, :ctx].float().sum())

    out = {}
    for rows in (1, 8):
        q = torch.randn(1, 9, rows, 64, generator=g)
        call = lambda i=0: k.attend(q, ks[i], vs[i], ctx - rows, True, True, True)  # noqa: E731
        cases = {"warm": lambda: call(),
                 "cold": lambda: flush.add_(1.0),
                 "cold, K/V read back": lambda: (flush.add_(1.0), touch(ks[0]), touch(vs[0])),
                 "cold, another layer's call first": lambda: (flush.add_(1.0), call(1)),
                 "cold, both": lambda: (flush.add_(1.0), touch(ks[0]), touch(vs[0]), call(1))}
        times: dict[str, list[float]] = {name: [] for name in list(cases) + [f"{LAYERS} layers in turn"]}
        for _ in range(args.rounds):
            for name, before in cases.items():
                before()
                began = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - began)
            began = time.perf_counter()
            for i in range(LAYERS):
                call(i)
            times[f"{LAYERS} layers in turn"].append((time.perf_counter() - began) / LAYERS)
        out[f"rows_{rows}"] = {name: round(statistics.median(v) * 1e6, 1) for name, v in times.items()}
        print(rows, out[f"rows_{rows}"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": lscpu(), "command": " ".join(["python"] + sys.argv),
                                               "context": ctx, "threads": args.threads, "rounds": args.rounds,
                                               "us_per_call": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
