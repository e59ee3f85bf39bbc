"""The block-size controller replayed on the real draft's real acceptance, at measured step costs: how much
does `auto` leave on the table against the best fixed block and against the best any policy could do?

Recording (the models run once): each prompt is decoded plainly (greedy, the target's own output), and at
every position the default draft proposes a block of every size 2..B from that anchor, as the runtime
would draft it (a draft trained for short blocks runs only its rows). Blocks of each size therefore accept
exactly what they would in real decoding at T=0. The draft's catch-up on new context is timed too.

Replay (no model runs): the same token sequence is emitted by plain decoding, by fixed blocks, by the real
AutoBlock controller (hetero_sd/decoding/controller.py: one Memory across the prompts, as in one bench run,
its cost model learning from the replayed step times), by the same controller with each block verified only as
far as the draft's own probabilities say it pays (`confident_prefix`), and by the optimum: a dynamic program over the
positions choosing plain or a block size at every step, knowing every future acceptance (no policy can
beat it). Step times are modelled from a `hetero-sd bench --costs --json` file: plain = decode; a block of b
= draft(b) + verify(b) (interpolated between measured sizes) + the draft's catch-up. Modelled, not timed:
the figures are tokens per decode step, comparable between policies, not speedups of a run.

    python benchmarks/controller_replay.py --limit 12 --max-new-tokens 128 \
        --costs benchmarks/results/costs/costs_r1.json --json benchmarks/results/controller/replay.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetero_sd  # noqa: E402
from hetero_sd.backends.base import logits_of  # noqa: E402
from hetero_sd.bench.runner import machine  # noqa: E402
from hetero_sd.decoding.controller import PLAIN, AutoBlock, Memory, interpolate  # noqa: E402
from hetero_sd.decoding.costs import Costs  # noqa: E402
from hetero_sd.prompts import load_prompts  # noqa: E402


@torch.inference_mode()
def record(rt, text: str, max_new: int) -> dict:
    """The prompt's ids, the target's greedy output y (y[0] from the prefill) and, per anchor y[t], the
    draft's block of every size: drafts[t][b] = the b-1 tokens it proposes after y[t], confidences[t][b] the
    draft's probability of each."""
    target, draft = rt.target, rt.draft
    target.crop(0)
    draft.crop(0)
    ids, _ = rt.encode(text)
    out = target.forward(ids, last_only=True)
    catch_up, confidence, confidences = [], [], []
    draft.add_context(out.features)
    y, drafts, sure = [int(out.logits[-1].argmax())], [], [round(float(out.logits[-1].softmax(-1).max()), 4)]
    while len(y) < max_new and y[-1] not in rt.stop_ids:
        blocks = {b: logits_of(draft.propose(y[-1], size=b)).softmax(-1).max(-1) for b in range(2, draft.block_size + 1)}
        drafts.append({b: top.tolist() for b, (_, top) in blocks.items()})
        confidences.append({b: [round(float(p), 4) for p in probs] for b, (probs, _) in blocks.items()})
        confidence.append(round(float(blocks[2][0][0]), 4))  # the draft's probability of its position-1 token, block of 2
        out = target.forward([y[-1]])
        began = time.perf_counter()
        draft.add_context(out.features)
        catch_up.append(time.perf_counter() - began)
        y.append(int(out.logits[-1].argmax()))
        sure.append(round(float(out.logits[-1].softmax(-1).max()), 4))  # the target's probability of its token
    return {"prompt_ids": list(ids), "y": y, "drafts": drafts, "confidence": confidence, "anchor_probability": sure,
            "confidences": confidences,
            "catch_up_s": statistics.median(catch_up) if catch_up else 0.0}


def accepted(trace: dict, t: int, b: int) -> int:
    """Drafts of the size-b block at anchor y[t] that match the target's next tokens."""
    y, n = trace["y"], 0
    for i, tok in enumerate(trace["drafts"][t][b]):
        if t + 1 + i >= len(y) or tok != y[t + 1 + i]:
            break
        n += 1
    return n


class Steps:
    """Modelled seconds of a plain step and of a block of each size (draft + verify + the draft's catch-up)."""

    def __init__(self, costs: Costs, catch_up_s: float):
        self.costs, self.catch_up = costs, catch_up_s

    def plain(self) -> float:
        return self.costs.decode_s

    def block(self, b: int) -> float:
        return interpolate(self.costs.draft_s, b) + interpolate(self.costs.verify_s, b) + self.catch_up


def replay(trace: dict, steps: Steps, choose) -> tuple[int, float]:
    """(tokens emitted, modelled seconds) when choose(t) -> PLAIN or a block size decides every step."""
    t, seconds, last = 0, 0.0, len(trace["y"]) - 1
    while t < last:
        size = choose(t)
        if size == PLAIN:
            seconds, t = seconds + steps.plain(), t + 1
        else:
            seconds, t = seconds + steps.block(size), min(t + accepted(trace, t, size) + 1, last)
    return last, seconds


def optimum(trace: dict, steps: Steps, sizes: range) -> tuple[int, float]:
    """The least modelled time to emit the trace, over every sequence of choices (knowing the acceptances)."""
    last = len(trace["y"]) - 1
    best = [0.0] * (last + 1)
    for t in range(last - 1, -1, -1):
        best[t] = min([steps.plain() + best[t + 1]] +
                      [steps.block(b) + best[min(t + accepted(trace, t, b) + 1, last)] for b in sizes])
    return last, best[0]


def gated(trace: dict, steps: Steps, tau: float) -> tuple[int, float]:
    """Draft a block of 2 at every step; verify it when the draft's probability of its token is >= tau, else
    decode plainly (the draft and its catch-up are paid either way: the confidence needs them)."""
    t, seconds, last = 0, 0.0, len(trace["y"]) - 1
    draft = steps.block(2) - interpolate(steps.costs.verify_s, 2)
    while t < last:
        if trace["confidence"][t] >= tau:
            seconds, t = seconds + steps.block(2), min(t + accepted(trace, t, 2) + 1, last)
        else:
            seconds, t = seconds + draft + steps.plain(), t + 1
    return last, seconds


def confident_prefix(confidences: list[float], size: int, steps: Steps) -> int:
    """How many of a drafted block's rows to verify (0: decode plainly, the draft paid): the prefix with the most
    expected tokens per second of this step, taking the draft's probabilities as the chance each draft is right
    given the ones before (a cut on the draft's distributions, not its draws: lossless, as sampling.gated)."""
    paid = interpolate(steps.costs.draft_s, size) + steps.catch_up
    best, rows, expected, run = 1 / (paid + steps.plain()), 0, 1.0, 1.0
    for k in range(1, size):
        run *= confidences[k - 1]
        expected += run
        rate = expected / (paid + interpolate(steps.costs.verify_s, k + 1))
        if rate > best:
            best, rows = rate, k
    return rows


def auto_replay(traces: list[dict], steps: Steps, max_size: int, cut: bool = False) -> tuple[int, float, dict]:
    """The real controller over the prompts in order, one Memory (its cost model learns from the replayed
    step times, as in a run); returns tokens, seconds and the histogram of its choices. `cut`: each block it
    drafts is verified only as far as `confident_prefix` says."""
    memory = Memory(steps.costs, max_size)
    tokens = seconds = 0.0
    chosen: dict[int, int] = {}
    for trace in traces:
        policy, y = AutoBlock(max_size, memory, trace["prompt_ids"]), trace["y"]
        t, last = 0, len(y) - 1
        while t < last:
            size = policy.choose()
            chosen[size] = chosen.get(size, 0) + 1
            rows = size - 1
            if size != PLAIN and cut:
                rows = confident_prefix(trace["confidences"][t][size], size, steps)
                if rows == 0:  # decoded plainly after all, the draft paid
                    seconds += interpolate(steps.costs.draft_s, size) + steps.catch_up
            if size == PLAIN or rows == 0:
                policy.emitted([y[t + 1]])
                policy.observe_plain(steps.plain())
                seconds, t = seconds + steps.plain(), t + 1
                continue
            a = min(accepted(trace, t, size), rows)
            end = min(t + a + 1, last)
            policy.emitted(y[t + 1:end + 1])
            cost = interpolate(steps.costs.draft_s, size) + interpolate(steps.costs.verify_s, rows + 1)
            policy.observe(rows + 1, rows, a, cost, steps.catch_up)
            seconds, t = seconds + cost + steps.catch_up, end
        policy.finish()
        tokens += last
    return int(tokens), seconds, dict(sorted(chosen.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--datasets", default="chat,humaneval")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--costs", default=str(ROOT / "benchmarks/results/costs/costs_r1.json"))
    ap.add_argument("--traces", help="JSON files written by --save-traces (comma-separated): replay without the models")
    ap.add_argument("--save-traces")
    ap.add_argument("--json")
    args = ap.parse_args()
    costs = Costs.from_json(json.loads(Path(args.costs).read_text()))
    if args.traces:  # comma-separated files of the same draft: their sets together
        recorded = None
        for path in args.traces.split(","):
            part = json.loads(Path(path).read_text())
            recorded = part if recorded is None else {**recorded, "sets": {**recorded["sets"], **part["sets"]}}
    else:
        rt = hetero_sd.load("default", args.draft, block_size="fixed")
        recorded = {"draft": rt.info.get("draft"), "draft_format": rt.info.get("draft_format"),
                    "block_size": rt.draft.block_size, "sets": {}}
        for name in args.datasets.split(","):
            recorded["sets"][name] = [record(rt, p.text, args.max_new_tokens) for p in load_prompts(None, name, args.limit)]
        if args.save_traces:
            Path(args.save_traces).write_text(json.dumps(recorded))
    size_max = recorded["block_size"]
    sizes = range(2, size_max + 1)
    result = {"command": " ".join(["python"] + sys.argv), "machine": machine(), "draft": recorded["draft"],
              "draft_format": recorded["draft_format"], "costs_from": args.costs,
              "note": "acceptance recorded from the models; step times modelled from the costs file", "sets": {}}
    for name, traces in recorded["sets"].items():
        for trace in traces:  # JSON keys are strings
            trace["drafts"] = [{int(b): d for b, d in row.items()} for row in trace["drafts"]]
            if "confidences" in trace:
                trace["confidences"] = [{int(b): c for b, c in row.items()} for row in trace["confidences"]]
        steps = Steps(costs, statistics.median(t["catch_up_s"] for t in traces))
        decode = costs.decode_s

        def per_step(pairs) -> float:  # tokens per decode step's time
            pairs = list(pairs)
            return round(sum(n for n, _ in pairs) / (sum(s for _, s in pairs) / decode), 3)

        policies = {"plain": per_step(replay(t, steps, lambda _: PLAIN) for t in traces)}
        for b in sizes:
            policies[f"fixed {b}"] = per_step(replay(t, steps, functools.partial(lambda b, _: b, b)) for t in traces)
        tokens, seconds, chosen = auto_replay(traces, steps, size_max)
        policies["auto"] = round(tokens / (seconds / decode), 3)
        if all("confidences" in t for t in traces):  # (traces recorded before the draft's probabilities were kept)
            tokens, seconds, _ = auto_replay(traces, steps, size_max, cut=True)
            policies["auto, verified as far as the draft is confident"] = round(tokens / (seconds / decode), 3)
        for tau in (0.3, 0.5, 0.7):
            policies[f"block 2 gated at p >= {tau}"] = per_step(gated(t, steps, tau) for t in traces)
        policies["optimum"] = per_step(optimum(t, steps, sizes) for t in traces)
        result["sets"][name] = {"prompts": len(traces), "tokens": sum(len(t["y"]) - 1 for t in traces),
                                "catch_up_ms": round(steps.catch_up * 1e3, 3),
                                "position_1_accepted": {b: round(statistics.mean(
                                    accepted(t, i, b) > 0 for t in traces for i in range(len(t["drafts"]))), 3)
                                    for b in sizes},
                                "tokens_per_decode_step": policies, "auto_choices": chosen}
        print(name, json.dumps(result["sets"][name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
