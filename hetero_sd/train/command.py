"""`hetero-sd train-draft`: self-distillation data (resumable), then training (resumable)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..sources import resolve_target
from .data import done_indices, generate_responses, load_rows
from .prompts import training_prompts
from .trainer import TrainConfig, train

err = Console(stderr=True)


def add_parser(sub) -> None:
    t = sub.add_parser("train-draft", help="train a DFlash draft for a target (self-distillation)")
    t.add_argument("--target", default="default")
    t.add_argument("--out", required=True, help="output folder: the z-lab draft, checkpoint, data")
    t.add_argument("--data", help="JSONL rows {index, prompt_ids, response_ids}; default OUT/data.jsonl")
    t.add_argument("--prompts", type=int, default=1600, help="training prompts to answer with the target")
    t.add_argument("--code-fraction", type=float, default=0.5, help="share of stdlib code prompts")
    t.add_argument("--max-new-tokens", type=int, default=200, help="length of the target's answers")
    t.add_argument("--gen-batch-size", type=int, default=48)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--accumulate", type=int, default=4)
    t.add_argument("--anchors", type=int, default=24)
    t.add_argument("--vocab", choices=["data", "full"], default="data",
                   help="softmax of the loss over the answers' tokens (~3x cheaper steps) or all tokens")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")


def bar(label: str) -> Progress:
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=err)


def run(args: argparse.Namespace) -> None:
    target = resolve_target(args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else out / "data.jsonl"
    if not args.data:
        prompts = training_prompts(args.prompts, args.code_fraction, args.seed)
        if len(done_indices(data)) < len(prompts):
            with bar("self-distillation data") as p:
                task = p.add_task("", total=len(prompts))
                generate_responses(target, prompts, data, max_new_tokens=args.max_new_tokens,
                                   batch_size=args.gen_batch_size,
                                   progress=lambda done, total: p.update(task, completed=len(prompts) - total + done))
    rows = load_rows(data)
    cfg = TrainConfig(block_size=args.block_size, layers=args.layers, steps=args.steps, lr=args.lr,
                      accumulate=args.accumulate, anchors=args.anchors, eval_every=args.eval_every, seed=args.seed,
                      vocab=args.vocab)
    err.print(f"training on {len(rows)} sequences ({sum(len(r['response_ids']) for r in rows)} response tokens)")
    with bar("train-draft") as p:
        task = p.add_task("", total=cfg.steps)
        tau = {"v": None}

        def progress(record):
            tau["v"] = record.get("held_out_tau", tau["v"])
            shown = f"loss {record['loss']:.3f}" + (f"  held-out tau {tau['v']:.2f}" if tau["v"] else "")
            p.update(task, completed=record["step"], description=shown)

        train(target, rows, out, cfg, resume=args.resume, progress=progress)
    err.print(f"draft written to {out} (config.json + model.safetensors, z-lab DFlash format)")
