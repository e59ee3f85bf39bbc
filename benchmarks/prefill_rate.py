"""Issue 26, prompt processing: a ~500-token prompt's prefill rate (tokens/s) of the default target in float32
(its prefill multiplies the float32 weights) and `--dtype int8` (its prefill multiplies int8 rows by the GGUF
blocks, as llama.cpp does), and llama.cpp's own prompt-eval rate on the same GGUF and tokens (llama-completion
from benchmarks/build_llama_cpp.sh, its `prompt eval time`), same thread count; best of `--reps`, our variants
and llama.cpp interleaved (the machine is shared).

    python benchmarks/prefill_rate.py [--tokens 500] [--reps 3] --json benchmarks/results/prefill_rate_avx2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import hetero_sd
from hetero_sd.bench.peers_llama import build_dir, build_info, number
from hetero_sd.prompts import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_ab import lscpu  # noqa: E402


def llama_prompt_rate(gguf: str, text: str, threads: int) -> tuple[float, int]:
    import subprocess
    args = [str(build_dir() / "bin" / "llama-completion"), "-m", gguf, "-t", str(threads), "-c", "2048", "-b", "2048",
            "--temp", "0", "-no-cnv", "--no-display-prompt", "--simple-io", "-n", "1", "-p", text]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    ms = number(r"prompt eval time =\s*([\d.]+) ms", proc.stderr)
    n = number(r"prompt eval time =\s*[\d.]+ ms / +(\d+) tokens", proc.stderr, int)
    return n / (ms / 1e3), n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    rts = {d: hetero_sd.load("default", None, dtype=d) for d in ("float32", "int8")}
    tok = rts["float32"].tokenizer
    text = "\n\n".join(p.text for d in ("chat", "math", "summarize") for p in load_prompts(dataset=d))
    ids = tok.encode(text, add_special_tokens=False)[:args.tokens]
    text = tok.decode(ids)
    best = {d: 0.0 for d in rts} | {"llama.cpp": 0.0}
    llama_tokens = None
    for _ in range(args.reps):
        for d, rt in rts.items():
            t = rt.target
            t.crop(0)
            began = time.perf_counter()
            t.forward(ids, features=False, last_only=True)
            best[d] = max(best[d], len(ids) / (time.perf_counter() - began))
            t.crop(0)
        if (build_dir() / "bin" / "llama-completion").is_file():
            rate, llama_tokens = llama_prompt_rate(rts["int8"].info["gguf"], text, threads)
            best["llama.cpp"] = max(best["llama.cpp"], rate)
        print({k: round(v, 1) for k, v in best.items()}, flush=True)
    doc = {"command": " ".join(["python"] + sys.argv), "lscpu": lscpu(), "threads": threads, "prompt_tokens": len(ids),
           "llama_cpp_prompt_tokens": llama_tokens, "llama_cpp": build_info(),
           "load_note": "shared 2-core VM (other helpers' jobs, a nice-19 training run): best of reps, indicative",
           "prefill_tokens_per_s": {k: round(v, 1) for k, v in best.items()}}
    if best["llama.cpp"]:
        doc["ours_over_llama_cpp"] = {d: round(best[d] / best["llama.cpp"], 3) for d in rts}
    print(json.dumps(doc, indent=1))
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
