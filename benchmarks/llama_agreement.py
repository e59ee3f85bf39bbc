"""Token agreement of our `--dtype int8` target (int8 rows x the GGUF's Q4_1/Q8_0 blocks, llama.cpp's
numerics) with llama.cpp itself on the same GGUF (the embedded default SmolLM2-135M-Instruct, Q4_1), greedy.

Each prompt goes through the chat template into token ids; llama.cpp (llama-completion of
benchmarks/build_llama_cpp.sh) gets those ids rendered back to text with their special tokens (it parses them;
its prompt length is checked against ours) and decodes N tokens greedily with EOS ignored, as ours does. Its
answer is text: it is compared with the decoding of our N tokens, and where they differ the first divergent
position is our first token whose text is not a prefix of llama.cpp's answer. There our int8 target's logits
say why: the margin between its top two logits, and whether llama.cpp's continuation starts with our
second choice (a near-tie that a different summation order or rounding flips). With --float32 our float32
target (the default numerics) is run on the same prompts too; --kv-float16: our int8 target with K in float16 (the
default keeps K as q8_0 blocks where the CPU has AVX512-VNNI); --kv-q8: with K as q8_0 blocks, explicitly;
--llama-ctk q8_0 runs llama.cpp itself with that K cache (llama.cpp's -ctk q8_0).

    python benchmarks/llama_agreement.py [--limit 20] [--tokens 128] [--float32] [--kv-q8] [--llama-ctk q8_0]
                                         [--json benchmarks/results/agreement/llama_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

import hetero_sd
from hetero_sd.bench.peers_llama import build_dir, build_info, number
from hetero_sd.bench.runner import machine
from hetero_sd.devices import capability
from hetero_sd.prompts import load_prompts


def llama_greedy(gguf: str, prompt: str, n: int, threads: int, ctk: str | None = None) -> dict:
    binary = build_dir() / "bin" / "llama-completion"
    args = [str(binary), "-m", gguf, "-t", str(threads), "-c", "2048", "-b", "2048", "--temp", "0", "--no-escape",
            "-no-cnv", "--no-display-prompt", "--simple-io", "--ignore-eos", "-n", str(n), "-p", prompt]
    args += ["-ctk", ctk] if ctk else []
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"llama-completion failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"text": proc.stdout.strip("\n"),
            "prompt_tokens": number(r"prompt eval time =\s*[\d.]+ ms / +(\d+) tokens", proc.stderr, int),
            "prompt_ms": number(r"prompt eval time =\s*([\d.]+) ms", proc.stderr),
            "eval_ms_per_token": number(r"\beval time =\s*[\d.]+ ms / +\d+ runs +\(\s*([\d.]+) ms per token",
                                        proc.stderr)}


def first_divergence(tokenizer, ours: list[int], theirs: str) -> int | None:
    """Our first token position whose decoded text is no longer a prefix of llama.cpp's answer (None: equal)."""
    if tokenizer.decode(ours) == theirs:
        return None
    for i in range(len(ours)):
        if not theirs.startswith(tokenizer.decode(ours[:i + 1])):
            return i
    return len(ours)  # ours is a strict prefix of theirs


def why(rt, prompt_ids: list[int], ours: list[int], at: int, theirs: str) -> dict:
    """Our int8 logits at the divergent position: top-2 margin and whether llama.cpp took our second choice."""
    t = rt.target.fork() if hasattr(rt.target, "fork") else rt.target
    t.crop(0)
    logits = t.forward(prompt_ids + ours[:at], features=False).logits[-1].float()
    t.crop(0)
    top = torch.topk(logits, 5)
    prefix = rt.tokenizer.decode(ours[:at])
    rest = theirs[len(prefix):]
    second = rt.tokenizer.decode([int(top.indices[1])])
    return {"ours": rt.tokenizer.decode([ours[at]]), "llama_cpp_continues": rest[:24],
            "top2_margin": round(float(top.values[0] - top.values[1]), 5),
            "top5": [[rt.tokenizer.decode([int(i)]), round(float(v), 4)] for v, i in zip(top.values, top.indices)],
            "llama_cpp_took_our_second_choice": bool(second) and rest.startswith(second)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--datasets", default="chat,math")
    ap.add_argument("--float32", action="store_true", help="also our float32 target")
    ap.add_argument("--kv-float32", action="store_true",
                    help="also the int8 target with a float32 K/V cache (the default keeps float16, as llama.cpp)")
    ap.add_argument("--kv-q8", action="store_true", help="also the int8 target with its K cache as q8_0 blocks")
    ap.add_argument("--kv-float16", action="store_true", help="also the int8 target with its K cache in float16")
    ap.add_argument("--llama-ctk", default=None, help="llama.cpp's K cache type (-ctk; default: its float16)")
    ap.add_argument("--json", default="benchmarks/results/agreement/llama_agreement.json")
    args = ap.parse_args()
    prompts = [p for d in args.datasets.split(",") for p in load_prompts(dataset=d)][:args.limit]
    threads = torch.get_num_threads()
    rts = {"int8": hetero_sd.load("default", None, dtype="int8")}
    if args.kv_float32:
        from hetero_sd.backends.policy import LoadPolicy
        rts["int8, float32 KV"] = hetero_sd.load("default", None, dtype="int8", policy=LoadPolicy(kv_f16=False))
    if args.kv_q8:
        from hetero_sd.backends.policy import LoadPolicy
        rts["int8, q8_0 K"] = hetero_sd.load("default", None, dtype="int8", policy=LoadPolicy(k_q8=True))
        if rts["int8, q8_0 K"].target.cache.k[0].dtype != torch.uint8:
            raise SystemExit("--kv-q8: no q8_0 K cache here (it needs AVX512-VNNI): " + "; ".join(rts["int8, q8_0 K"].notes))
    if args.kv_float16:
        from hetero_sd.backends.policy import LoadPolicy
        rts["int8, float16 K"] = hetero_sd.load("default", None, dtype="int8", policy=LoadPolicy(k_q8=False))
    if args.float32:
        rts["float32"] = hetero_sd.load("default", None, dtype="float32")
    gguf = rts["int8"].info["gguf"]
    rows = []
    for n, p in enumerate(prompts):
        ids, _ = rts["int8"].encode(p.text)
        text = rts["int8"].tokenizer.decode(ids, skip_special_tokens=False)
        began = time.perf_counter()
        theirs = llama_greedy(gguf, text, args.tokens, threads, args.llama_ctk)
        row = {"prompt": p.text[:80], "category": p.category, "prompt_tokens": len(ids),
               "llama_cpp_prompt_tokens": theirs["prompt_tokens"], "llama_cpp_s": round(time.perf_counter() - began, 2)}
        for name, rt in rts.items():
            ours = rt.generate(ids, max_new_tokens=args.tokens, temperature=0.0, speculative=False).token_ids
            at = first_divergence(rt.tokenizer, ours, theirs["text"])
            row[name] = {"exact": at is None, "first_divergence": at}
            if at is not None and at < len(ours):
                row[name]["why"] = why(rt, ids, ours, at, theirs["text"])
        rows.append(row)
        print(f"{n:2d} prompt {len(ids)}/{theirs['prompt_tokens']} " + "  ".join(
              f"{d} {'=' if row[d]['exact'] else row[d]['first_divergence']!s:>4} "
              f"{row[d].get('why', {}).get('top2_margin', '')}" for d in rts) + f"  {p.text[:50]!r}", flush=True)
        write(args, rows, rts, gguf, threads, done=n + 1 == len(prompts))


def median(values: list) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def write(args, rows: list, rts: dict, gguf: str, threads: int, done: bool) -> None:
    """The JSON after every prompt (a run cut short keeps what it finished: `complete` says which)."""
    summary = {name: {"exact_match": sum(r[name]["exact"] for r in rows), "prompts": len(rows),
                      "exact_match_rate": round(sum(r[name]["exact"] for r in rows) / len(rows), 3),
                      "first_divergences": [r[name]["first_divergence"] for r in rows],
                      "divergences_at_our_second_choice": sum(r[name].get("why", {}).get(
                          "llama_cpp_took_our_second_choice", False) for r in rows),
                      "median_top2_margin_at_divergence": median([r[name]["why"]["top2_margin"] for r in rows
                                                                  if "why" in r[name]])}
               for name in rts}
    doc = {"command": " ".join(["python"] + sys.argv), "machine": {**machine(), "capability": capability()}, "threads": threads,
           "llama_cpp": build_info(), "llama_cpp_k_cache": args.llama_ctk or "f16 (its default)",
           "gguf": gguf, "tokens": args.tokens, "greedy": True, "eos_ignored": True,
           "load_note": "shared 2-core VM (other helpers' jobs, a nice-19 training run): times are indicative",
           "complete": done, "summary": summary, "rows": rows}
    if done:
        print(json.dumps(summary, indent=1))
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
