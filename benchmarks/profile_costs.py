"""Where a decode step, a verify of --verify tokens and a draft block of --block spend their time:
torch.profiler over a few calls of each on a --context-token context, one table per call (self CPU time by op).

    python benchmarks/profile_costs.py --out benchmarks/results/profile_after.txt [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from hetero_sd.decoding.costs import cpu_name, fill_context, fill_ids
from hetero_sd.runtime import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft-dtype", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    ap.add_argument("--verify", type=int, default=16, help="tokens in the verify call")
    ap.add_argument("--block", type=int, default=8, help="the draft block's size (at most the draft's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = load("default", "cpu-trained", dtype=args.dtype, **({"draft_dtype": args.draft_dtype} if args.draft_dtype else {}))
    target, draft = rt.target, rt.draft
    fill_context(target, draft, args.context)
    base, vocab = target.length, target.config.vocab_size
    calls = {"decode step (1 token)": lambda: target.forward(fill_ids(1, vocab), features=False),
             f"verify {args.verify} tokens": lambda: target.forward(fill_ids(args.verify, vocab)),
             f"draft block {args.block}": lambda: draft.propose(fill_ids(1, vocab)[0], size=args.block)}
    lines = [f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"target {target.dtype}, draft {draft.dtype}; {args.calls} calls each after 2 warm-up calls", ""]
    for name, fn in calls.items():
        for _ in range(2):
            fn()
            target.crop(base)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                fn()
                target.crop(base)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        lines += [f"## {name}", table, ""]
        print(f"## {name}\n{table}")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
