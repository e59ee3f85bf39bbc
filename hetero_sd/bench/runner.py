"""`hetero-sd bench`: the autoregressive baseline and speculative decoding on the same prompts, same
backend, same process, interleaved prompt by prompt so that machine noise hits both alike."""

from __future__ import annotations

import os
import platform
import sys
from typing import Sequence

import torch

from hetero_sd.decoding.costs import cpu_model
from hetero_sd.backends.drift import Drift
from hetero_sd.errors import ConfigError
from .repetition import LOOP_NGRAM, add_counts, loop_counts, loop_figures, step_lengths
from hetero_sd.prompts import Prompt
from hetero_sd.runtime import Runtime, check_schedule
from hetero_sd.decoding.stats import Stats
from hetero_sd.decoding.timeline import overlap_fraction

WARMUP = "Say hello."


def machine() -> dict:
    return {"platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count(), "python": sys.version.split()[0],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def warm_shapes(runtime: Runtime, prompts: list[Prompt], max_new_tokens: int) -> None:
    """Every step shape the timed runs can meet, run before them (Runtime.warm): the longest prompt with the whole
    answer after it. Where steps are captured on a shape's first use (CUDA graphs), none is captured inside a
    prompt's time; elsewhere it runs nothing."""
    if prompts:
        runtime.warm(max(len(runtime.encode(p.text)[0]) for p in prompts) + max_new_tokens)


def run_bench(runtime: Runtime, prompts: list[Prompt], *, max_new_tokens: int = 256, temperature: float = 0.0,
              seed: int = 0, rule: str = "match", schedules: Sequence[str] = ("sequential",),
              blocks: Sequence = (None,), progress=None) -> dict:
    """Baseline and each (schedule, block setting) on the same prompts. Per-prompt schedules alternate
    with the baseline prompt by prompt; "pipeline" (two requests at once) runs the whole set after them.
    blocks: None (the runtime's), a size, or "auto"; pipeline runs with the first."""
    if runtime.draft is None:
        raise ConfigError("bench needs a draft and none is loaded", "pass --draft FOLDER or --draft random (API: draft=FOLDER)")
    for schedule in schedules:
        check_schedule(schedule)
    gen = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, rule=rule)
    for speculative in (False, True):  # warm-up: first calls pay for allocation and kernel selection
        runtime.generate(WARMUP, max_new_tokens=8, speculative=speculative, schedule=schedules[0])
    warm_shapes(runtime, prompts, max_new_tokens)
    single = [(s, b) for s in schedules if s != "pipeline" for b in blocks]
    rows, runs, references, drifts = [], {key: [] for key in single}, [], []
    # A reduced-precision draft device: its drift is measured on a pass of its own at the draft's full
    # block on every step, beside the rows (the controller may decode plainly and run no block at all).
    reference = getattr(runtime.draft, "reference", None)
    interrupted = False
    try:
        for n, prompt in enumerate(prompts):
            base = runtime.generate(prompt.text, speculative=False, **gen)
            for schedule, block in single:
                runs[schedule, block].append(runtime.generate(prompt.text, schedule=schedule, block=block, **gen))
            if reference is not None:
                drifts.append(runtime.generate(prompt.text, schedule="sequential", block="fixed", **gen))
                references.append(runtime.generate(prompt.text, schedule="sequential", block="fixed",
                                                   draft=reference, **gen))
            first = runs[single[0]][-1] if single else None
            rows.append(row(n, prompt, base, first, temperature) if first else baseline_row(n, prompt, base))
            if progress:
                progress(rows[-1])
        if "pipeline" in schedules:
            runs["pipeline", blocks[0]] = runtime.generate_many([p.text for p in prompts], schedule="pipeline",
                                                                block=blocks[0], **gen)
    except KeyboardInterrupt:  # keep the prompts that finished; a half-done prompt is dropped everywhere
        if not rows or not single:
            raise
        interrupted = True
        runs = {key: gens[:len(rows)] for key, gens in runs.items() if key[0] != "pipeline"}
        references, drifts = references[:len(rows)], drifts[:len(rows)]
    result = summary(runtime, rows, runs, gen)
    if references:
        result["drift"] = drift_summary(drifts, references)
        if single:  # what the first row's own generations compared (none where it decoded plainly)
            result["drift"]["in_row"] = Drift.total([g.stats.drift for g in runs[single[0]] if g.stats.drift]).to_dict()
    if interrupted:
        result["interrupted"] = True
    return result


def drift_summary(device_runs: list, reference_runs: list) -> dict:
    """The device's drift against the float32 reference, and tau(device) / tau(reference) on the same
    prompts, both at the draft's full block on every step."""
    drift = Drift.total([g.stats.drift for g in device_runs if g.stats.drift]).to_dict()
    tau_device = pooled(device_runs, device_runs[0].stats.block_size).tau
    tau_reference = pooled(reference_runs, reference_runs[0].stats.block_size).tau
    return drift | {"pass": f"block {device_runs[0].stats.block_size} on every step", "tau_device": tau_device,
                    "tau_reference": tau_reference, "tau_ratio": tau_device / tau_reference if tau_reference else None}


def baseline_row(n: int, prompt: Prompt, base) -> dict:
    return {"index": n, "category": prompt.category, "prompt": prompt.text,
            "baseline_tokens": base.stats.num_generated_tokens, "baseline_s": base.stats.total_s,
            "baseline_tokens_per_s": base.stats.tokens_per_s, "baseline_ids": base.token_ids,
            **loops_row(base.token_ids)}


def row(n: int, prompt: Prompt, base, spec, temperature: float) -> dict:
    diverges = first_divergence(base.token_ids, spec.token_ids)
    return baseline_row(n, prompt, base) | {
        "spec_tokens": spec.stats.num_generated_tokens, "spec_s": spec.stats.total_s,
        "spec_tokens_per_s": spec.stats.tokens_per_s, "tau": spec.stats.tau,
        "steps": spec.stats.num_drafts, "accepted": spec.stats.num_accepted_tokens,
        "accepted_per_step": spec.stats.accepted_per_step,
        "identical": diverges is None if temperature == 0 else None,
        "first_divergence": diverges if temperature == 0 else None,
        "draft_s": spec.stats.draft_s, "verify_s": spec.stats.verify_s,
        "acceptance": spec.stats.acceptance, "device_steps": spec.stats.device_steps,
        "output": spec.text, "output_ids": spec.token_ids,
    } | loops_row(spec.token_ids, spec.stats.accepted_per_step,
                  spec.stats.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else None)


def loops_row(ids: list[int], accepted_per_step: list[int] | None = None, speedup: float | None = None) -> dict:
    """Loop counts of one answer (see repetition.py) and its figures: loop share; with its verify steps,
    tau and speedup on everything and on the loop-free part."""
    lengths = None if accepted_per_step is None else step_lengths(accepted_per_step, len(ids))
    counts = loop_counts(ids, lengths)
    return {"loop": counts} | loop_figures(counts, speedup)


def schedule_row(key: tuple, gens: list, rows: list[dict], base_tps: float, temperature: float,
                 default_block: str = "fixed") -> dict:
    schedule, block = key
    stats = [g.stats for g in gens]
    timelines = {id(s.timeline): s.timeline for s in stats}.values()
    wall = (gens[0].stats.timeline.wall_s() if schedule == "pipeline" else sum(s.total_s for s in stats))
    tokens = sum(s.num_generated_tokens for s in stats)
    total = pooled(gens, stats[0].block_size)
    return {"schedule": schedule, "block": block or default_block, "wall_s": wall, "tokens": tokens, "tau": total.tau,
            "spec_tokens_per_s": tokens / wall, "speedup": tokens / wall / base_tps,
            "overlap_fraction": overlap_fraction(timelines),
            "lossless": (all(g.token_ids == r["baseline_ids"] for g, r in zip(gens, rows))
                         if temperature == 0 else None),
            "predraft_hit_rate": total.predraft_hit_rate if total.predraft_steps else None,
            "draft_to_verify_cost": cost_ratio(timelines),
            "mean_verify_s": mean_span(timelines, "verify"), "mean_draft_s": mean_span(timelines, "draft"),
            "fallbacks": sum(s.fallback is not None for s in stats),
            "block_size_histogram": total.block_size_histogram,
            "tokens_by_mode": {m: sum(s.tokens_by_mode[m] for s in stats) for m in stats[0].tokens_by_mode},
            # the context lookup (decoding/lookup.py): its weight, the proposals it changed, and the blocks of its
            # guesses alone (no draft pass) among the verified blocks
            "lookup": {"weight": stats[0].lookup_weight, "drafts_changed": sum(s.lookup_drafts for s in stats),
                       "blocks": sum(s.lookup_blocks for s in stats),
                       "verified_blocks": sum(s.num_drafts for s in stats)},
            } | controller_row(stats)


def controller_row(stats) -> dict:
    """What the controller did over the run (block "auto"): its probes and plain checks, and the costs it
    used at the end."""
    seen = [s.controller for s in stats if s.controller]
    if not seen:
        return {}
    return {"controller": {"probes": sum(c["probes"] for c in seen),
                           "probes_that_paid": sum(c["probes_that_paid"] for c in seen),
                           "plain_checks": sum(c.get("plain_checks", 0) for c in seen),
                           "last": seen[-1]}}


def mean_span(timelines, name: str) -> float | None:
    """Mean seconds of one kind of job ("verify", "draft") over the given timelines."""
    spans = [s.end - s.start for t in timelines for s in t.spans if s.name == name]
    return sum(spans) / len(spans) if spans else None


def cost_ratio(timelines) -> float | None:
    """Mean draft job over mean verify job: how much a step's draft costs relative to its verify."""
    draft, verify = mean_span(timelines, "draft"), mean_span(timelines, "verify")
    return draft / verify if draft and verify else None


def summary(runtime: Runtime, rows: list[dict], runs: dict, gen: dict) -> dict:
    base_tok, base_s = sum(r["baseline_tokens"] for r in rows), sum(r["baseline_s"] for r in rows)
    base_tps = base_tok / base_s
    schedules = [schedule_row(key, gens, rows, base_tps, gen["temperature"], runtime.block)
                 for key, gens in runs.items()]
    main = schedules[0]
    first = next(iter(runs.values()))
    total = pooled(first, runtime.block_size)
    for r in rows:
        r.pop("baseline_ids")
    return {
        "machine": machine(), "models": runtime.info, "settings": gen, "command": " ".join(sys.argv),
        "schedule": main["schedule"], "tau": main["tau"], "speedup": main["speedup"],
        "baseline_tokens_per_s": base_tps, "spec_tokens_per_s": main["spec_tokens_per_s"],
        "lossless": main["lossless"], "schedules": schedules,
        "loops": {"ngram": LOOP_NGRAM} | loop_figures(add_counts([r["loop"] for r in rows]), main["speedup"]),
        "acceptance_rate_per_position": total.acceptance_rate_per_position,
        "acceptance_length_histogram": total.acceptance_length_histogram,
        "draft_acceptance_rate": total.draft_acceptance_rate,
        "time_split_s": {"prefill": total.prefill_s, "draft": total.draft_s, "verify": total.verify_s,
                         "other": total.other_s},
        "categories": categories(rows, first), "notes": runtime.notes, "prompts": rows,
        "timelines": [(f"{s} block {b or runtime.block} #{g.stats.request}", g.stats.timeline)
                      for (s, b), gens in runs.items() for g in (gens if s != "pipeline" else gens[:1])],
    }


def categories(rows: list[dict], gens: list) -> dict:
    """Per-category totals of the first schedule (its generations: `gens`, one per row) against the baseline."""
    out = {}
    for name in dict.fromkeys(r["category"] for r in rows):
        mine = [r for r in rows if r["category"] == name and "spec_tokens" in r]
        if not mine:
            continue
        base = sum(r["baseline_tokens"] for r in mine) / sum(r["baseline_s"] for r in mine)
        spec = sum(r["spec_tokens"] for r in mine) / sum(r["spec_s"] for r in mine)
        tau = pooled([gens[r["index"]] for r in mine], 0).tau  # over the set's steps, as the run's own tau is
        out[name] = {"prompts": len(mine), "baseline_tokens_per_s": base, "spec_tokens_per_s": spec,
                     "speedup": spec / base, "tau": tau}
        out[name] |= loop_figures(add_counts([r["loop"] for r in mine]), spec / base)
    return out


def pooled(gens: list, block_size: int) -> Stats:
    return Stats.pooled([g.stats for g in gens], block_size)
