"""What a step costs inside the real decoding loop, next to what `hetero-sd bench --costs` probes.

The controller replay (controller_replay.py) models a block step as draft(b) + verify(b) + catch-up from a
`bench --costs` file, whose probe runs each call alone, warm, at 512 tokens of context. This script times the
same calls where the loop makes them: real generations (default target and draft, T=0) at fixed block sizes
and plainly, with the target's forward and the draft's catch-up and block wrapped by timers. Per step it
reports the wall time, the target's forward (a plain step's row, or the verify of anchor + drafts), the
draft's catch-up on new context and its block, and the rest (sampling, acceptance, the controller, stats,
lanes). The timers add ~1 us a call.

    python benchmarks/loop_costs.py [--blocks 2,3,4] [--limit 6] [--max-new-tokens 128] [--json out.json]
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
from hetero_sd.prompts import load_prompts  # noqa: E402
from timing import options  # noqa: E402


class Timers:
    """Wraps a backend's methods; every call's seconds are appended under its name."""

    def __init__(self, backend, names: list[str]):
        self.calls: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            setattr(backend, name, self.wrap(name, getattr(backend, name)))

    def wrap(self, name, f):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            out = f(*args, **kwargs)
            self.calls[name].append(time.perf_counter() - began)
            return out
        return timed

    def total(self, name: str) -> float:
        return sum(self.calls[name])

    def reset(self) -> None:
        for v in self.calls.values():
            v.clear()


def run(rt, prompts: list[str], max_new_tokens: int, block: int | None, target: Timers, draft: Timers) -> dict:
    target.reset()
    draft.reset()
    wall = steps = tokens = prefill = 0.0
    for p in prompts:
        began = time.perf_counter()
        g = rt.generate(p, max_new_tokens=max_new_tokens, speculative=block is not None,
                        block=block if block else None)
        wall += time.perf_counter() - began
        prefill += g.stats.prefill_s
        tokens += len(g.token_ids)
        steps += (g.stats.num_drafts if block else len(g.token_ids) - 1)
    forwards = target.calls["forward"]
    target_s = sum(forwards) - prefill  # the prompt's forward is not a step
    per = lambda s: round(s / steps * 1e3, 4)  # noqa: E731
    row = {"block": block or "plain", "prompts": len(prompts), "tokens": int(tokens), "steps": int(steps),
           "tau": round(tokens / steps, 3) if steps else None,
           "ms_per_step": {"wall": per(wall - prefill), "target_forward": per(target_s),
                           "draft_catch_up": per(draft.total("add_context")), "draft_block": per(draft.total("propose"))}}
    ms = row["ms_per_step"]
    ms["rest"] = round(ms["wall"] - ms["target_forward"] - ms["draft_catch_up"] - ms["draft_block"], 4)
    row["ms_per_token"] = round((wall - prefill) / tokens * 1e3, 4)
    return row


OPTIONS = {"--blocks": (str, "2,3,4"), "--dataset": (str, "chat"), "--limit": (int, 6), "--max-new-tokens": (int, 128),
           "--threads": (int, 2), "--json": (str, None)}


def main() -> None:
    args = options(OPTIONS)
    torch.set_num_threads(args.threads)
    prompts = [p.text for p in load_prompts(dataset=args.dataset, limit=args.limit)]
    blocks = [int(b) for b in args.blocks.split(",")]
    rt = hetero_sd.load("default", "default", block_size=max(blocks))
    target, draft = Timers(rt.target, ["forward"]), Timers(rt.draft, ["add_context", "propose"])
    run(rt, prompts[:2], 16, None, target, draft)  # warm-up: kernels, caches, first allocations
    rows = []
    for block in [None] + blocks:
        rows.append(run(rt, prompts, args.max_new_tokens, block, target, draft))
        print(json.dumps(rows[-1]))
    plain = rows[0]["ms_per_step"]["wall"]
    for row in rows[1:]:
        row["step_in_plain_steps"] = round(row["ms_per_step"]["wall"] / plain, 3)
        row["speedup"] = round(rows[0]["ms_per_token"] / row["ms_per_token"], 3)
    out = {"machine": machine(), "command": " ".join(sys.argv), "dataset": args.dataset, "threads": args.threads,
           "models": {k: rt.info.get(k) for k in ("target", "draft", "target_dtype", "draft_dtype", "weight_plan")},
           "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print("wrote", args.json)


if __name__ == "__main__":
    main()
