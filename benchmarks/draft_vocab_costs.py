"""A draft block's cost with the full head vs reduced draft vocabularies (issue 25, part 2), in decode steps,
measured interleaved in one process on one target: every round times a decode step and each head's block in
turn, so that load from other jobs falls on all of them alike; the figure is the median over rounds of
each round's (block / decode step) ratio.

    python benchmarks/draft_vocab_costs.py --draft cpu-trained --reduced /tmp/dv4k /tmp/dv8k /tmp/dv16k \
        --json benchmarks/results/draft_vocab_costs.json

`--variant HETERO_SD_DRAFT_LAYERS=float` adds the same draft loaded under that load policy (e.g. its own
matrices in float32 instead of int8 rows x Q8_0 blocks), timed in the same rounds.

The reduced drafts are made with `hetero-sd draft-vocab --draft cpu-trained --k K --out DIR`; each shares the
target (and its GGUF head blocks) with the full draft, as `load` builds them (int8 head rows on the CPU)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetero_sd  # noqa: E402
from hetero_sd.backends import torch_backend  # noqa: E402
from hetero_sd.decoding.costs import fill_ids, step  # noqa: E402
from hetero_sd.models.config import DraftConfig  # noqa: E402
from timing import median as timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="cpu-trained")
    ap.add_argument("--reduced", nargs="+", default=[])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variant", action="append", default=[], metavar="HETERO_SD_X=VALUE",
                    help="also the draft under this load policy (repeatable)")
    ap.add_argument("--load-note", default="shared: other helpers' tests and a niced training run were running, so "
                                           "absolute times are inflated and indicative")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = hetero_sd.load("default", args.draft, block_size="fixed")
    target = rt.target
    drafts = {f"full ({rt.info['draft_head']})": rt.draft}
    for variant in args.variant:
        from hetero_sd.cli.policy import policy_from_env

        name, _, value = variant.partition("=")
        other = hetero_sd.load("default", args.draft, block_size="fixed", policy=policy_from_env({name: value}))
        drafts[f"{variant} ({other.info['draft_head']})"] = other.draft
    for folder in args.reduced:
        cfg = DraftConfig.from_folder(Path(folder))
        d = torch_backend.load_draft(Path(folder), cfg, target, "cpu", rt.draft.dtype, rt.draft.mask_token_id)
        drafts[f"{Path(folder).name} ({cfg.format.draft_vocab_size} rows)"] = d
    vocab = target.config.vocab_size
    target.crop(0)
    features = target.forward(fill_ids(args.context, vocab), last_only=True, features=True).features
    base = target.length
    for d in drafts.values():  # the same context for every draft: the target's features of the fill
        d.crop(0)
        d.add_context(features)
    blocks = [int(b) for b in args.blocks.split(",")]
    ratios = {name: {b: [] for b in blocks} for name in drafts}
    decode = []
    for _ in range(args.rounds):
        dec = timed(lambda: step(target, base, fill_ids(1, vocab), features=False), args.repeats)
        decode.append(dec)
        for name, d in drafts.items():
            for b in blocks:
                ratios[name][b].append(timed(lambda: d.propose(fill_ids(1, vocab)[0], size=b), args.repeats) / dec)
    out = {"what": "draft block cost in decode steps, full head vs reduced draft vocabularies, interleaved rounds",
           "cpu": f"{os.cpu_count()}-core, {torch.backends.cpu.get_cpu_capability()}; {args.load_note}; ratios were "
                  "measured in the same rounds",
           "variants": args.variant,
           "lscpu_model": platform.processor() or subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"],
                                                                 capture_output=True, text=True).stdout.strip(),
           "load_average_at_end": os.getloadavg(), "torch_threads": torch.get_num_threads(),
           "context": base, "rounds": args.rounds, "repeats_per_round": args.repeats,
           "decode_step_ms_median": round(statistics.median(decode) * 1e3, 3),
           "draft_notes": {name: [n for n in getattr(d, "notes", []) if "head" in n or "layers" in n]
                           for name, d in drafts.items()},
           "block_in_decode_steps": {name: {b: round(statistics.median(v), 3) for b, v in r.items()}
                                     for name, r in ratios.items()}}
    full = next(iter(ratios))
    out["vs_full"] = {name: {b: round(statistics.median(r[b]) / statistics.median(ratios[full][b]), 3) for b in blocks}
                      for name, r in ratios.items()}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
