"""`hetero-sd bench`: the autoregressive baseline and speculative decoding on the same prompts, same
backend, same process, interleaved prompt by prompt so that machine noise hits both alike."""

from __future__ import annotations

import os
import platform
import sys

import torch

from .prompts import Prompt
from .runtime import Runtime
from .stats import Stats

WARMUP = "Say hello."


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_bench(runtime: Runtime, prompts: list[Prompt], *, max_new_tokens: int = 256, temperature: float = 0.0,
              seed: int = 0, rule: str = "match", progress=None) -> dict:
    if runtime.draft is None:
        raise ValueError("bench needs a draft")
    gen = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, rule=rule)
    for speculative in (False, True):  # warm-up: first calls pay for allocation and kernel selection
        runtime.generate(WARMUP, max_new_tokens=8, speculative=speculative)
    rows, spec_stats = [], []
    for n, prompt in enumerate(prompts):
        base = runtime.generate(prompt.text, speculative=False, **gen)
        spec = runtime.generate(prompt.text, speculative=True, **gen)
        spec_stats.append(spec.stats)
        rows.append(row(n, prompt, base, spec, temperature))
        if progress:
            progress(rows[-1])
    return summary(runtime, rows, spec_stats, gen)


def row(n: int, prompt: Prompt, base, spec, temperature: float) -> dict:
    diverges = first_divergence(base.token_ids, spec.token_ids)
    return {
        "index": n, "category": prompt.category, "prompt": prompt.text,
        "baseline_tokens": base.stats.num_generated_tokens, "baseline_s": base.stats.total_s,
        "baseline_tokens_per_s": base.stats.tokens_per_s,
        "spec_tokens": spec.stats.num_generated_tokens, "spec_s": spec.stats.total_s,
        "spec_tokens_per_s": spec.stats.tokens_per_s, "tau": spec.stats.tau,
        "identical": diverges is None if temperature == 0 else None,
        "first_divergence": diverges if temperature == 0 else None,
        "draft_s": spec.stats.draft_s, "verify_s": spec.stats.verify_s,
        "output": spec.text,
    }


def summary(runtime: Runtime, rows: list[dict], spec_stats: list[Stats], gen: dict) -> dict:
    base_tok, base_s = sum(r["baseline_tokens"] for r in rows), sum(r["baseline_s"] for r in rows)
    spec_tok, spec_s = sum(r["spec_tokens"] for r in rows), sum(r["spec_s"] for r in rows)
    total = merge(spec_stats, runtime.block_size)
    base_tps, spec_tps = base_tok / base_s, spec_tok / spec_s
    return {
        "machine": machine(), "models": runtime.info, "settings": gen, "command": " ".join(sys.argv),
        "tau": total.tau, "speedup": spec_tps / base_tps,
        "baseline_tokens_per_s": base_tps, "spec_tokens_per_s": spec_tps,
        "lossless": all(r["identical"] for r in rows) if gen["temperature"] == 0 else None,
        "acceptance_rate_per_position": total.acceptance_rate_per_position,
        "acceptance_length_histogram": total.acceptance_length_histogram,
        "draft_acceptance_rate": total.draft_acceptance_rate,
        "time_split_s": {"prefill": total.prefill_s, "draft": total.draft_s, "verify": total.verify_s,
                         "other": total.other_s},
        "notes": runtime.notes, "prompts": rows,
    }


def merge(stats: list[Stats], block_size: int) -> Stats:
    total = Stats(block_size=block_size)
    for s in stats:
        for a in s.accepted_per_step:
            total.record_step(block_size - 1, a)
        total.num_generated_tokens += s.num_generated_tokens
        for name in ("prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
    return total

