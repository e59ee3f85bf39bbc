"""Issue 26: the int8-row kernel (kernels/quant8.cpp) of a git revision against the working tree's, in ONE
process, interleaved per row count (the machine is shared), minimum over `--reps` calls, one torch thread; the
outputs of both are asserted bitwise equal first (a kernel change must not move a single bit).

    python benchmarks/quant8_ab.py --rev 61aff88 --json benchmarks/results/quant8_ab_avx2.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hetero_sd.backends.torch_backend import quant, quant8
from hetero_sd.backends.torch_backend.kernels import build

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402
from int8_rows import SHAPES, random_rows  # noqa: E402
from timing import best  # noqa: E402


def old_kernel(rev: str):
    """quant8.cpp at `rev`, built under another op namespace (two TORCH_LIBRARY blocks cannot share one)."""
    src = subprocess.run(["git", "show", f"{rev}:backends/torch_backend/kernels/quant8.cpp"], capture_output=True,
                         text=True, check=True).stdout.replace("hetero_sd_quant8", "hetero_sd_q8rev")
    folder = Path(tempfile.mkdtemp())
    (folder / "q8rev.cpp").write_text(src)
    ops = build("q8rev", folder)
    if isinstance(ops, Exception):
        raise ops
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,4,8,16,33,64,256")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    old = old_kernel(args.rev)
    out = {"command": " ".join(["python"] + sys.argv), "lscpu": lscpu(), "isa": quant8.isa(), "threads": 1,
           "load_note": "shared 2-core VM (other helpers' jobs, a nice-19 training run): minimum of reps, indicative",
           "us": {}}
    for name, kind, n, k in SHAPES:
        q = quant8.Int8Blocks(kind, random_rows(kind, n, k), None)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k) * 3
            before = lambda: old.qgemm8.default(x, q.packed, kind == quant.Q4_1, q.avx512, 0, q.n)  # noqa: E731
            assert torch.equal(before(), q.product(x)), (name, m)
            a, b = best(before, args.reps), best(lambda: q.product(x), args.reps)
            out["us"][f"{name} x{m}"] = {"before": round(a * 1e6, 1), "after": round(b * 1e6, 1),
                                         "after/before": round(b / a, 3)}
            print(f"{name:8s} rows {m:3d}  before {a * 1e6:9.1f} us  after {b * 1e6:9.1f} us  ({b / a:.3f})", flush=True)
    out["bitwise_equal"] = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
