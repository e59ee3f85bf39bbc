"""Self-distillation speed: our batched generator (hetero_sd/train/batched.py) against transformers'
batched `generate` (the previous recipe: batches of 48, sorted by prompt length, left-padded), on the same
prompts in one process, in the order ours, transformers, [ours in bfloat16,] ours (disturbances from
other jobs fall on both). Also checks that the answers agree: with each other, and for a few prompts with the runtime's own
greedy decoding.

    python benchmarks/datagen_speed.py --prompts 64 --max-new-tokens 256 --threads 1 [--int8] [--no-transformers] \
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


def ours(folder, prompts, args, stops, dtype=torch.float32, numerics="float32", fused=True):
    from hetero_sd.train.batched import BatchedGenerator

    gen = BatchedGenerator(folder, slots=args.slots, max_new_tokens=args.max_new_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, stop_ids=stops, dtype=dtype, numerics=numerics,
                           fused=fused)
    for note in gen.notes:
        print(f"note: {note}", flush=True)
    began, cpu = time.perf_counter(), time.process_time()
    answers = {a.key: a.response_ids for a in gen.generate(sorted(prompts, key=lambda p: len(p[1])))}
    return answers, time.perf_counter() - began, time.process_time() - cpu


def transformers_generate(folder, prompts, args, stops):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    pad, answers = stops[0], {}
    ordered = sorted(prompts, key=lambda p: len(p[1]))
    began, cpu = time.perf_counter(), time.process_time()
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
    return answers, time.perf_counter() - began, time.process_time() - cpu


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
    ap.add_argument("--bf16", action="store_true",
                    help="also ours in bfloat16 (weights, KV cache), between the float32 runs")
    ap.add_argument("--int8", action="store_true",
                    help="also ours on the int8 target (int8 rows x the GGUF blocks: the default CPU target), "
                         "between the float32 runs; its answers are checked against that target's own greedy ones")
    ap.add_argument("--int8-torch-ops", action="store_true",
                    help="also the int8 target on torch's ops (the generator before the slot kernels), before ours-int8")
    ap.add_argument("--no-float32", action="store_true", help="leave out ours in float32 (with --int8: int8 runs only)")
    ap.add_argument("--no-transformers", action="store_true", help="leave out transformers' generate")
    ap.add_argument("--note", default="2 shared cores; other helpers' jobs ran at the same time (see load averages)")
    ap.add_argument("--out", default="benchmarks/results/datagen_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import hetero_sd
    from hetero_sd.loading.default_model import default_target_folder
    from hetero_sd.train.corpus import training_mix
    from hetero_sd.train.distill import chat_ids

    folder = default_target_folder()
    rt = hetero_sd.load("default", None, dtype="float32")  # the float32 target (the CPU default on a GGUF is int8)
    stops = rt.stop_ids
    mix, _ = training_mix(seed=1)  # another order than the data job's (seed 0)
    prompts = [(p.key, chat_ids(rt.tokenizer, p.text)) for p in mix[:args.prompts * 2]]
    prompts = [p for p in prompts if len(p[1]) <= args.max_prompt_tokens][:args.prompts]
    state = cpu_state()
    runs = []
    order = [("ours", ours), ("transformers", transformers_generate), ("ours", ours)]
    if args.bf16:
        def ours_bf16(*a):
            return ours(*a, dtype=torch.bfloat16)
        order = order[:2] + [("ours-bf16", ours_bf16)] + order[2:]
    if args.int8:
        def ours_int8(*a):
            return ours(*a, numerics="int8")
        order = order[:-1] + [("ours-int8", ours_int8)] + order[-1:]
    if args.int8_torch_ops:
        def ours_int8_torch(*a):
            return ours(*a, numerics="int8", fused=False)
        at = [n for n, _ in order].index("ours-int8") if args.int8 else len(order) - 1
        order = order[:at] + [("ours-int8-torch-ops", ours_int8_torch)] + order[at:]
        if args.int8:  # and once more after: the two int8 generators alternate (the VM's speed drifts)
            order = order[:at + 2] + [("ours-int8-torch-ops", ours_int8_torch), ("ours-int8", ours_int8)] + order[at + 2:]
    if args.no_transformers:
        order = [o for o in order if o[0] != "transformers"]
    if args.no_float32:
        order = [o for o in order if o[0] != "ours"]
    for name, fn in order:
        answers, seconds, cpu = fn(folder, prompts, args, stops)
        tokens = sum(len(v) for v in answers.values())
        runs.append({"generator": name, "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "tokens": tokens,
                     "tokens_per_s": round(tokens / seconds, 1), "tokens_per_cpu_s": round(tokens / cpu, 1),
                     "answers": answers})
        print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s "
              f"({cpu:.1f} CPU s = {tokens / cpu:.1f} tokens per CPU s)", flush=True)
    checks = []
    named = {r["generator"]: r for r in runs}
    for key, ids in prompts[:args.runtime_checks] if "ours" in named else []:
        ref = rt.generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=True).token_ids
        checks.append({"key": key, "runtime_tokens": len(ref), "equal_to_ours": ref == named["ours"]["answers"][key]})
    if args.int8:
        from hetero_sd.backends.policy import LoadPolicy

        # the int8 target as the runtime runs it (fused C++ ops) and with torch's ops, as generation runs it
        for fused in (True, False):
            rt8 = hetero_sd.load("default", None, dtype="int8", policy=LoadPolicy(fused=fused))
            for key, ids in prompts[:args.runtime_checks]:
                ref = rt8.generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=True).token_ids
                checks.append({"key": key, "int8": True, "runtime_fused_ops": fused, "runtime_tokens": len(ref),
                               "equal_to_ours": ref == named["ours-int8"]["answers"][key]})
    base = named.get("transformers", runs[0])

    def speedup(run: dict, unit: str) -> float:
        return round(run[unit] / base[unit], 2)

    def mean(name: str, unit: str) -> float:
        values = [r[unit] for r in runs if r["generator"] == name]
        return round(sum(values) / len(values), 1)

    by_generator = {name: {u: mean(name, u) for u in ("tokens_per_s", "tokens_per_cpu_s")} for name in named}
    ours_float32 = {"generator": "ours", **by_generator.get("ours", by_generator[runs[0]["generator"]])}
    extra = {"by_generator_mean": by_generator}
    if args.int8 and args.int8_torch_ops:
        extra["int8_slot_kernels_over_int8_torch_ops"] = {
            u: round(mean("ours-int8", u) / mean("ours-int8-torch-ops", u), 2) for u in ("tokens_per_s", "tokens_per_cpu_s")}
        extra["agreement_int8_slot_kernels_vs_int8_torch_ops"] = agreement(named["ours-int8"]["answers"],
                                                                           named["ours-int8-torch-ops"]["answers"])
    if args.int8 and "ours" in named:
        extra["int8_over_ours_float32"] = {u: round(named["ours-int8"][u] / ours_float32[u], 2)
                                           for u in ("tokens_per_s", "tokens_per_cpu_s")}
        extra["agreement_ours_int8_vs_float32"] = agreement(runs[0]["answers"], named["ours-int8"]["answers"])
    if args.bf16:
        extra = {"speedup_ours_bf16_vs_transformers": {u: speedup(named["ours-bf16"], u) for u in ("tokens_per_s",
                                                                                       "tokens_per_cpu_s")},
                 "agreement_ours_bf16_vs_float32": agreement(runs[0]["answers"], named["ours-bf16"]["answers"])}
    result = {
        "what": "greedy self-distillation answers, same prompts, one process, in this order: "
                + ", ".join(r["generator"] for r in runs) + " (ours: float32 unless named)",
        "state": {**state, "load_average_at_end": os.getloadavg(), "torch_threads": args.threads,
                  "note": args.note},
        "settings": {k: getattr(args, k) for k in ("prompts", "max_new_tokens", "max_prompt_tokens", "slots",
                                                    "hf_batch", "threads")},
        "runs": [{k: v for k, v in r.items() if k != "answers"} for r in runs],
        # per CPU second: with 1 thread, what the process did when it ran; wall time also counts what
        # other jobs on the 2 shared cores took from it, which changed between the runs
        "speedup_ours_float32_vs_transformers": ({u: speedup(ours_float32, u) for u in ("tokens_per_s", "tokens_per_cpu_s")}
                                                 if "transformers" in named else None),
        "agreement_ours_vs_transformers": (agreement(runs[0]["answers"], named["transformers"]["answers"])
                                           if "transformers" in named else None),
        "agreement_ours_run1_vs_run2": agreement(runs[0]["answers"], runs[-1]["answers"]),
        **extra,
        "runtime_greedy_checks": checks,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
