"""The block-size controller on text that is predictable in stretches (issue 14's third benchmark).

A test double stands in for the draft: an oracle that proposes the target's own greedy continuation on
stretches of the answer (e.g. 48 tokens right, 48 wrong, ...) and a wrong token elsewhere. On such text
the best fixed block size is a compromise; the controller can decode plainly where the draft is wrong
and use long blocks where it is right. Plain decoding, fixed blocks 16/8/4 and `auto` run on the same
prompts in one process, interleaved prompt by prompt; every run is checked token for token against
plain decoding. The oracle costs almost nothing to run, so the speculative steps cost what their
verify costs (plus the controller's cost model, measured with the untrained draft of the same shape
and corrected online).

    python benchmarks/controller_oracle.py [--limit 4] [--max-new-tokens 192] [--stretch 48] \
        [--json benchmarks/results/controller_oracle.json]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetero_sd  # noqa: E402
from hetero_sd.bench.runner import machine  # noqa: E402
from hetero_sd.prompts import load_prompts  # noqa: E402
from tests.doubles import OracleDraft, with_draft  # noqa: E402

SETTINGS = ("plain", 16, 8, 4, "auto")


def stretches(start: int, length: int):
    """Right on [start + 2k*length, start + (2k+1)*length), wrong on the stretches between."""
    return lambda position: position >= start and ((position - start) // length) % 2 == 0


def run_prompt(rt, prompt: str, max_new: int, stretch: int) -> dict:
    base = rt.generate(prompt, max_new_tokens=max_new, speculative=False)
    truth = base.prompt_ids + base.token_ids
    # predictable from the answer's second stretch on: the answer opens on a wrong stretch
    right = stretches(len(base.prompt_ids) + stretch, stretch)
    out = {"plain": {"tokens": len(base.token_ids), "seconds": base.stats.total_s}}
    for setting in SETTINGS[1:]:
        oracle = OracleDraft(truth, 16, rt.target.config.vocab_size, right=right)
        g = with_draft(rt, oracle, "sequential", "auto", rt.memory).generate(prompt, max_new_tokens=max_new,
                                                                           block=setting)
        out[str(setting)] = {"tokens": len(g.token_ids), "seconds": g.stats.total_s, "tau": g.stats.tau,
                             "lossless": g.token_ids == base.token_ids,
                             "block_size_histogram": g.stats.block_size_histogram,
                             "tokens_by_mode": g.stats.tokens_by_mode, "switches": g.stats.switches}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--stretch", type=int, default=48)
    ap.add_argument("--dataset", default="chat", help="prompt set (humaneval: answers long enough for stretches)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "controller_oracle.json"))
    args = ap.parse_args()
    rt = hetero_sd.load("default", "random")  # the draft's shape for the cost model; replaced by the oracle
    prompts = [p.text for p in load_prompts(None, args.dataset, args.limit)]
    rt.generate("Say hello.", max_new_tokens=8, speculative=False)  # warm-up
    rows = []
    for n, prompt in enumerate(prompts):
        began = time.perf_counter()
        rows.append(run_prompt(rt, prompt, args.max_new_tokens, args.stretch))
        print(f"prompt {n + 1}/{len(prompts)} done in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    totals = {s: {"tokens_per_s": sum(r[s]["tokens"] for r in rows) / sum(r[s]["seconds"] for r in rows)}
              for s in map(str, SETTINGS)}
    for s in map(str, SETTINGS[1:]):
        totals[s]["speedup"] = totals[s]["tokens_per_s"] / totals["plain"]["tokens_per_s"]
        totals[s]["lossless"] = all(r[s]["lossless"] for r in rows)
    best_fixed = max(map(str, SETTINGS[1:-1]), key=lambda s: totals[s]["tokens_per_s"])
    doc = {"machine": machine(), "command": " ".join(sys.argv), "settings": vars(args),
           "draft": "oracle test double: right on alternate stretches of the greedy answer",
           "costs": rt.memory.cost.to_dict(), "totals": totals, "best_fixed": best_fixed,
           "auto_vs_best_fixed": totals["auto"]["tokens_per_s"] / totals[best_fixed]["tokens_per_s"],
           "auto_vs_plain": totals["auto"]["speedup"], "prompts": rows}
    Path(args.json).write_text(json.dumps(doc, indent=1))
    for s in map(str, SETTINGS):
        t = totals[s]
        print(f"{s:>6}: {t['tokens_per_s']:6.1f} tok/s  {t.get('speedup', 1.0):.2f}x  lossless {t.get('lossless', True)}")
    print(f"auto / best fixed ({best_fixed}): {doc['auto_vs_best_fixed']:.2f}x; auto / plain: {doc['auto_vs_plain']:.2f}x")
    print(f"switches (first prompt): {rows[0]['auto']['switches']}")


if __name__ == "__main__":
    main()
