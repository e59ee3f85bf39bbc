"""Self-distillation speed: our batched generator (hetero_sd/train/batched.py) against transformers'
batched `generate` (the previous recipe: batches of 48, sorted by prompt length, left-padded), on the same
prompts in one process, in the order ours, transformers, ours (disturbances from other jobs fall on
both). Also checks that the answers agree: with each other, and for a few prompts with the runtime's own
greedy decoding.

    python benchmarks/datagen_speed.py --prompts 64 --max-new-tokens 256 --threads 1 \
        --out benchmarks/results/datagen_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def cpu_state() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "")
    return {"cpu": model, "cores": os.cpu_count(), "capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_start": os.getloadavg()}


def ours(folder, prompts, args, stops):
    from hetero_sd.train.batched import BatchedGenerator

    gen = BatchedGenerator(folder, slots=args.slots, max_new_tokens=args.max_new_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, stop_ids=stops)
    began = time.perf_counter()
    answers = {a.key: a.response_ids for a in gen.generate(sorted(prompts, key=lambda p: len(p[1])))}
    return answers, time.perf_counter() - began


def transformers_generate(folder, prompts, args, stops):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    pad, answers = stops[0], {}
    ordered = sorted(prompts, key=lambda p: len(p[1]))
    began = time.perf_counter()
    for b in range(0, len(ordered), args.hf_batch):
        batch = ordered[b:b + args.hf_batch]
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=stops)
        for (key, _), seq in zip(batch, out[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(seq) if t in stops), len(seq))
            answers[key] = seq[:cut]
    return answers, time.perf_counter() - began


def agreement(a: dict, b: dict) -> dict:
    same = sum(a[k] == b[k] for k in a)
    prefix = [next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k])))
              for k in a if a[k] != b[k]]
    return {"identical": same, "of": len(a), "first_difference_at": sorted(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--slots", type=int, default=48)
    ap.add_argument("--hf-batch", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runtime-checks", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/datagen_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import hetero_sd
    from hetero_sd.default_model import default_target_folder
    from hetero_sd.train.corpus import training_mix
    from hetero_sd.train.distill import chat_ids

    folder = default_target_folder()
    rt = hetero_sd.load("default", None)
    stops = rt.stop_ids
    mix, _ = training_mix(seed=1)  # another order than the data job's (seed 0)
    prompts = [(p.key, chat_ids(rt.tokenizer, p.text)) for p in mix[:args.prompts * 2]]
    prompts = [p for p in prompts if len(p[1]) <= args.max_prompt_tokens][:args.prompts]
    state = cpu_state()
    runs = []
    for name, fn in [("ours", ours), ("transformers", transformers_generate), ("ours", ours)]:
        answers, seconds = fn(folder, prompts, args, stops)
        tokens = sum(len(v) for v in answers.values())
        runs.append({"generator": name, "seconds": round(seconds, 1), "tokens": tokens,
                     "tokens_per_s": round(tokens / seconds, 1), "answers": answers})
        print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s", flush=True)
    checks = []
    for key, ids in prompts[:args.runtime_checks]:
        ref = rt.generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=True).token_ids
        checks.append({"key": key, "runtime_tokens": len(ref), "equal_to_ours": ref == runs[0]["answers"][key]})
    ours_rate = (runs[0]["tokens_per_s"] + runs[2]["tokens_per_s"]) / 2
    result = {
        "what": "greedy self-distillation answers, float32, same prompts, one process: ours, transformers, ours",
        "state": {**state, "load_average_at_end": os.getloadavg(), "torch_threads": args.threads,
                  "note": "2 shared cores; other helpers' jobs ran at the same time (see load averages)"},
        "settings": {k: getattr(args, k) for k in ("prompts", "max_new_tokens", "max_prompt_tokens", "slots",
                                                    "hf_batch", "threads")},
        "runs": [{k: v for k, v in r.items() if k != "answers"} for r in runs],
        "speedup_ours_mean_vs_transformers": round(ours_rate / runs[1]["tokens_per_s"], 2),
        "agreement_ours_vs_transformers": agreement(runs[0]["answers"], runs[1]["answers"]),
        "agreement_ours_run1_vs_run2": agreement(runs[0]["answers"], runs[2]["answers"]),
        "runtime_greedy_checks": checks,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
