"""Chart of the cost curve from one or more `hetero-sd bench --costs --json X.json` files: the target's
forward of k tokens and the draft's block of size b, each as a multiple of one decode step, with the
issue-12 goals (verify-16 <= 1.5 decode steps, draft-16 <= 0.25) drawn in.

    python benchmarks/cost_curve.py benchmarks/results/costs_before.json benchmarks/results/costs_after.json \
        --labels before,after --out benchmarks/results/costs.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--labels", default=None, help="comma-separated, one per file (default: the file names)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [Path(f).stem for f in args.files]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5.2))
    for path, label in zip(args.files, labels):
        c = json.load(open(path))["costs"]
        name = f"{label}: decode {c['decode_s'] * 1e3:.1f} ms ({c['dtype']})"
        ks = sorted(int(k) for k in c["verify_s"])
        left.plot(ks, [c["verify_s"][str(k)] / c["decode_s"] for k in ks], marker="o", label=name)
        bs = sorted(int(b) for b in c["draft_s"])
        right.plot(bs, [c["draft_s"][str(b)] / c["decode_s"] for b in bs], marker="o", label=name)
    left.axhline(1.5, color="grey", ls="--", lw=1, label="goal at k=16: 1.5")
    right.axhline(0.25, color="grey", ls="--", lw=1, label="goal at b=16: 0.25")
    left.set(title="target forward of k tokens (512-token context)", xlabel="k tokens", ylabel="x one decode step",
             xscale="log", xticks=ks, xticklabels=[str(k) for k in ks], ylim=(0, None))
    right.set(title="draft block of size b", xlabel="block size b", ylabel="x one decode step", xticks=bs,
              ylim=(0, None))
    # one legend under both plots: the labels name the numerics and are too long to sit inside a plot
    handles, labels = left.get_legend_handles_labels()
    extra = right.get_legend_handles_labels()
    fig.legend(handles + extra[0][-1:], labels + extra[1][-1:], loc="lower center", fontsize=7, ncol=1)
    cpu = json.load(open(args.files[-1]))["costs"]["cpu"]
    fig.suptitle(cpu, fontsize=8)
    fig.tight_layout(rect=(0, 0.2, 1, 1))  # room for the legend below
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
