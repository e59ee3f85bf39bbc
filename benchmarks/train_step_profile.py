"""Where a training step's time goes, on any device: the trainer's own `optimizer_step` (split attention,
chunked loss, AdamW) on packed batches of the default draft's shape, timed for several split-attention group
sizes and loss chunks, then one step of the fastest and of the first variant under torch.profiler.

Why: a lent H200 trained the 4-layer draft at ~4 s a step (64 sequences), ~63 ms a sequence, for a model of
a few million parameters (benchmarks/TRAINING.md, "The 17th session's lease"); a step of the split attention
is a loop over groups of 32 blocks, and each group once read its key span back to the host (two syncs per
group and layer). This measures what the group size and the loss's chunk do to a step where it runs.

Batches are synthetic but shaped like the stores' rows (prompt ~70, answer ~190 tokens, capped at 256; every
answer token an anchor; half the blocks short, as --short-blocks 0.5), features random: the step's arithmetic
does not depend on their values. With --rows ROWS.jsonl (train-draft --data rows) the real lengths are drawn.

    python benchmarks/train_step_profile.py --device cuda --layers 4 --pack 32 --forwards 2 \\
        --groups 32,256,1024 --chunks 1024,16384 --out OUT.json [--trace OUT.txt]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from hetero_sd.models.config import read_json
from hetero_sd.train.model import TrainingDraft, TrainingVocab
from hetero_sd.train.trainer import (Batch, TrainConfig, attention_path, block_labels, block_lengths,
                                     optimizer_step, sample_anchors, train_device)

DRAFT = Path(__file__).resolve().parents[1] / "hetero_sd/data/drafts/SmolLM2-135M-Instruct-cpu-trained/config.json"


def lengths_from(rows: Path | None, rng: random.Random, count: int) -> list[tuple[int, int]]:
    """(prompt, answer) lengths: from train-draft rows, or the stores' shape (see the docstring)."""
    if rows is not None:
        pairs = [(len(r["prompt_ids"]), len(r["response_ids"])) for r in map(json.loads, rows.open())]
        return [rng.choice(pairs) for _ in range(count)]
    return [(rng.randint(20, 125), 256 if rng.random() < 0.55 else rng.randint(8, 255)) for _ in range(count)]


def batch(rng, raw, count: int, device, rows: Path | None) -> Batch:
    width = len(raw["dflash_config"]["target_layer_ids"]) * raw["hidden_size"]
    parts, offset = {"tokens": [], "anchors": [], "starts": [], "ends": []}, 0
    for p, a in lengths_from(rows, rng, count):
        s = p + a
        chosen = sample_anchors(rng, p, s, 0) + offset  # 0: every answer token with a successor
        parts["tokens"].append(torch.randint(0, 8192, (s,)))
        parts["anchors"].append(chosen)
        parts["starts"].append(torch.full_like(chosen, offset))
        parts["ends"].append(torch.full_like(chosen, offset + s))
        offset += s
    cat = {k: torch.cat(v).to(device) for k, v in parts.items()}
    features = torch.randn(offset, width, dtype=torch.bfloat16, device=device)
    lengths = block_lengths(rng, int(cat["anchors"].shape[0]), raw["block_size"], 0.5).to(device)
    return Batch(features, cat["tokens"], cat["anchors"], cat["starts"], cat["ends"], None, lengths)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pack", type=int, default=32, help="sequences per forward")
    ap.add_argument("--forwards", type=int, default=2, help="forwards per step (the step has pack x forwards)")
    ap.add_argument("--groups", default="32,256,1024", help="split-attention group sizes to time")
    ap.add_argument("--chunks", default="1024,16384", help="loss chunks to time")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant (after one warm-up step)")
    ap.add_argument("--rows", type=Path, help="train-draft rows (JSONL): draw real lengths")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--trace", type=Path, help="torch.profiler tables of one step (first and fastest variant)")
    args = ap.parse_args()

    device, autocast = train_device(args.device, "auto")
    raw = read_json(DRAFT)
    raw.update(num_hidden_layers=args.layers, layer_types=["full_attention"] * args.layers)
    torch.manual_seed(0)
    rng = random.Random(0)
    table = torch.randn(raw["vocab_size"], raw["hidden_size"], device=device) * 0.02  # the target's frozen rows
    model = TrainingDraft(raw, table, table.clone()).to(device)
    vocab = TrainingVocab([{"response_ids": list(range(8192))}], model.lm_head, frequent=8192)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, betas=(0.9, 0.95))
    batches = [batch(rng, raw, args.pack, device, args.rows) for _ in range(args.forwards)]
    counts = [args.pack] * args.forwards
    blocks = sum(int(b.anchors.shape[0]) for b in batches)
    tokens = sum(int(b.tokens.shape[0]) for b in batches)

    def step(cfg) -> None:
        split = attention_path(model, cfg)
        vocab.draw(rng, torch.cat([block_labels(b.tokens, b.anchors, 8, b.ends).flatten() for b in batches]))
        weights = torch.exp(-torch.arange(7, device=device) / cfg.decay())
        optimizer_step(model, optim, counts, batches, weights, vocab, split, cfg, autocast)

    variants = []
    for group in map(int, args.groups.split(",")):
        for chunk in map(int, args.chunks.split(",")):
            cfg = TrainConfig(block_size=8, layers=args.layers, accumulate=args.pack * args.forwards, pack=args.pack,
                              gamma=2, short_blocks=0.5, attention_group=group, ce_chunk=chunk, device=device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = []
            try:
                step(cfg)  # warm-up
                for _ in range(args.steps):
                    sync(device)
                    t0 = time.perf_counter()
                    step(cfg)
                    sync(device)
                    times.append(time.perf_counter() - t0)
            except torch.OutOfMemoryError as e:  # a large group's scores: recorded, the others still timed
                optim.zero_grad(set_to_none=True)
                print(json.dumps({"group": group, "chunk": chunk, "error": str(e).splitlines()[0]}), flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            med = statistics.median(times)
            row = {"group": group, "chunk": chunk, "step_s": round(med, 4), "steps_s": [round(t, 4) for t in times],
                   "blocks_per_s": round(blocks / med, 1)}
            if device == "cuda":
                row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            print(json.dumps(row), flush=True)
            variants.append((cfg, row))

    best = min(variants, key=lambda v: v[1]["step_s"])
    result = {"what": "train_step_profile", "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
              "torch": torch.__version__, "autocast": str(autocast), "layers": args.layers, "pack": args.pack,
              "forwards": args.forwards, "blocks_per_step": blocks, "tokens_per_step": tokens,
              "rows": str(args.rows) if args.rows else "synthetic lengths", "command": " ".join(sys.argv),
              "variants": [row for _, row in variants], "fastest": best[1]}
    args.out.write_text(json.dumps(result, indent=1) + "\n")  # before the traces: a cut-off call keeps the timings
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        with args.trace.open("w") as out:
            for name, (cfg, row) in (("fastest", best), ("first", variants[0])):  # the slow one last
                with profile(activities=acts) as prof:
                    step(cfg)
                    sync(device)
                events = prof.key_averages()
                launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
                result[f"{name}_kernel_launches"] = launches
                out.write(f"== {name}: group {row['group']}, chunk {row['chunk']}, {launches} kernel launches\n")
                out.write(events.table(sort_by=sort, row_limit=25) + "\n")
                out.flush()
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["fastest"]), result.get("first_kernel_launches"), result.get("fastest_kernel_launches"))


if __name__ == "__main__":
    main()
