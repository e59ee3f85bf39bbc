"""Prompt processing and the decode step against llama.cpp: a ~500-token prompt's prefill rate
(tokens/s) of the default target in float32 (its prefill multiplies the float32 weights) and `--dtype int8` (its
prefill multiplies int8 rows by the GGUF blocks, as llama.cpp does), and llama.cpp's own prompt-eval rate on the
same GGUF and tokens (llama-completion from benchmarks/build_llama_cpp.sh, its `prompt eval time`); then
`--decode-tokens` greedy decode steps after that prompt, ours timed per step and llama.cpp's from its own `eval
time` (ms per run). Same thread count; best of `--reps`, our variants and llama.cpp interleaved.

    python benchmarks/prefill_rate.py [--tokens 500] [--reps 3] [--decode-tokens 128] --load-note "quiet" --json benchmarks/results/costs/prefill_rate.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import hetero_sd
from hetero_sd.bench.peers_llama import build_dir, build_info, number
from hetero_sd.bench.runner import machine
from hetero_sd.devices import capability
from hetero_sd.prompts import load_prompts


def llama_rates(gguf: str, text: str, threads: int, decode: int) -> tuple[float, int, float]:
    """llama.cpp's (prompt tokens/s, prompt tokens, ms per decode step), from its own llama_perf timings."""
    import subprocess
    args = [str(build_dir() / "bin" / "llama-completion"), "-m", gguf, "-t", str(threads), "-c", "2048", "-b", "2048",
            "--temp", "0", "-no-cnv", "--no-display-prompt", "--simple-io", "-n", str(decode), "-p", text,
            "--ignore-eos"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    ms = number(r"prompt eval time =\s*([\d.]+) ms", proc.stderr)
    n = number(r"prompt eval time =\s*[\d.]+ ms / +(\d+) tokens", proc.stderr, int)
    eval_ms = number(r"\beval time =\s*([\d.]+) ms / +\d+ runs", proc.stderr)
    runs = number(r"\beval time =\s*[\d.]+ ms / +(\d+) runs", proc.stderr, int)
    return n / (ms / 1e3), n, eval_ms / runs


def our_decode_ms(target, ids: list[int], steps: int) -> float:
    """Mean ms of one greedy decode step (one token through the target, logits of it) after the prompt."""
    target.crop(0)
    nxt = int(target.forward(ids, features=False, last_only=True).logits[-1].argmax())
    began = time.perf_counter()
    for _ in range(steps):
        nxt = int(target.forward([nxt], features=False, last_only=True).logits[-1].argmax())
    spent = time.perf_counter() - began
    target.crop(0)
    return spent / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--json", required=True)
    ap.add_argument("--load-note", default="say what else ran on the machine")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    rts = {d: hetero_sd.load("default", None, dtype=d) for d in ("float32", "int8")}
    tok = rts["float32"].tokenizer
    text = "\n\n".join(p.text for d in ("chat", "math", "summarize") for p in load_prompts(dataset=d))
    ids = tok.encode(text, add_special_tokens=False)[:args.tokens]
    text = tok.decode(ids)
    best = {d: 0.0 for d in rts} | {"llama.cpp": 0.0}
    step_ms = {d: float("inf") for d in best}
    llama_tokens = None
    for _ in range(args.reps):
        for d, rt in rts.items():
            t = rt.target
            t.crop(0)
            began = time.perf_counter()
            t.forward(ids, features=False, last_only=True)
            best[d] = max(best[d], len(ids) / (time.perf_counter() - began))
            t.crop(0)
            step_ms[d] = min(step_ms[d], our_decode_ms(t, ids, args.decode_tokens))
        if (build_dir() / "bin" / "llama-completion").is_file():
            rate, llama_tokens, ms = llama_rates(rts["int8"].info["gguf"], text, threads, args.decode_tokens)
            best["llama.cpp"] = max(best["llama.cpp"], rate)
            step_ms["llama.cpp"] = min(step_ms["llama.cpp"], ms)
        print({k: round(v, 1) for k, v in best.items()}, {k: round(v, 2) for k, v in step_ms.items()}, flush=True)
    doc = {"command": " ".join(["python"] + sys.argv), "machine": {**machine(), "capability": capability()}, "threads": threads, "prompt_tokens": len(ids),
           "llama_cpp_prompt_tokens": llama_tokens, "llama_cpp": build_info(),
           "load_note": args.load_note,
           "prefill_tokens_per_s": {k: round(v, 1) for k, v in best.items()},
           "decode_tokens": args.decode_tokens, "decode_step_ms_after_prompt": {k: round(v, 3) for k, v in step_ms.items()}}
    if best["llama.cpp"]:
        doc["prefill_ours_over_llama_cpp"] = {d: round(best[d] / best["llama.cpp"], 3) for d in rts}
        doc["decode_speed_ours_over_llama_cpp"] = {d: round(step_ms["llama.cpp"] / step_ms[d], 3) for d in rts}
    print(json.dumps(doc, indent=1))
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
