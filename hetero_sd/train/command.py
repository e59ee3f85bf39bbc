"""`hetero-sd train-draft`: self-distillation data (resumable), then training (resumable)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import torch

from hetero_sd.errors import ConfigError
from hetero_sd.loading.sources import resolve_target
from .data import done_indices, generate_responses, load_rows
from .distill import generate_shards, load_stores, unanswered
from .prompts import training_prompts
from .trainer import TrainConfig, check_packing, train

err = Console(stderr=True)


def add_parser(sub) -> None:
    t = sub.add_parser("train-draft", help="train a DFlash draft for a target (self-distillation)")
    t.add_argument("--target", default="default")
    t.add_argument("--out", help="output folder: the z-lab draft, checkpoint, data (not with --generate-only)")
    t.add_argument("--data", help="JSONL rows {index, prompt_ids, response_ids}; default OUT/data.jsonl")
    t.add_argument("--distill", metavar="DIR", action="append",
                   help="self-distillation shards of the ShareGPT + stdlib mix in DIR: trained on as they are "
                        "(repeatable: several stores, each with its own held-out rows), or made/extended with "
                        "--generate-only (one DIR)")
    t.add_argument("--skip-answered", metavar="DIR", action="append", default=[],
                   help="with --generate-only: leave out the prompts another store DIR has answered (repeatable)")
    t.add_argument("--generate-only", action="store_true",
                   help="with --distill: answer the mix's prompts not yet in DIR (resumable), do not train")
    t.add_argument("--sharegpt-turns", choices=["first", "all"], default="first",
                   help="with --distill: ShareGPT conversation openings only, or every human turn")
    t.add_argument("--mix-seed", type=int, default=0, help="with --distill: the order of the prompt mix")
    t.add_argument("--max-prompt-tokens", type=int, default=384, help="with --distill: longer prompts are left out")
    t.add_argument("--gen-dtype", choices=["float32", "int8", "bfloat16"], default="float32",
                   help="with --distill: the answers of the float32 target (the shards so far), of the int8 target "
                        "(a GGUF's CPU default: int8 rows x its blocks, on its kernels), or bfloat16 (approximate)")
    t.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own)")
    t.add_argument("--prompts", type=int,
                   help="training prompts to answer with the target (default 1600; with --distill: the whole mix)")
    t.add_argument("--code-fraction", type=float, default=0.5, help="share of stdlib code prompts")
    t.add_argument("--max-new-tokens", type=int, help="length of the target's answers (default 200; --distill 256)")
    t.add_argument("--gen-batch-size", type=int, default=48, help="answers generated at once")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--layers", type=int, default=2,
                   help="draft layers; above the --init-from draft's: a deeper draft grown from it (its new layers "
                        "start as identities, reading the old draft's feature layers)")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--accumulate", type=int, default=4, help="sequences per optimizer step")
    t.add_argument("--gamma", type=float,
                   help="loss weight of block position k: exp(-(k-1)/gamma) (default: DFlash's 7 at block 16, 4 at 8); "
                        "small values put the loss on the first positions, the only ones a weak draft gets accepted")
    t.add_argument("--short-blocks", type=float, default=0.0,
                   help="share of blocks trained at a random shorter length 2..B-1 (0..1): the block-size "
                        "controller drafts 2..B, and a draft trained only at B reads position 1 worse in short blocks")
    t.add_argument("--pack", type=int, default=1,
                   help="sequences per forward, packed end to end with a mask that keeps them apart")
    t.add_argument("--device", default="cpu", help="cpu, cuda or mps: where the draft trains")
    t.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto",
                   help="bf16 autocast (auto: on CUDA with bf16, float32 elsewhere)")
    t.add_argument("--anchors", type=int, default=0,
                   help="blocks per sequence per step: 0 (default) trains every response token, N: N random ones")
    t.add_argument("--attention", choices=["auto", "split", "dense"], default="auto",
                   help="split: block-vs-context + within-block attention (train/fast.py); dense: one masked "
                        "matrix (other draft formats); auto: split where it applies")
    t.add_argument("--attention-group", type=int, default=0, metavar="N",
                   help="blocks per context group of the split attention (0: 32 on the CPU, 256 on a GPU, "
                        "where small groups make a step launch-bound)")
    t.add_argument("--ce-chunk", type=int, default=0, metavar="N",
                   help="rows per chunk of the chunked cross-entropy (0: 1024 on the CPU, 16384 on a GPU)")
    t.add_argument("--feature-numerics", choices=["float32", "int8"], default="float32",
                   help="the target's rows for the draft's features: float32, or int8 (the runtime's default CPU "
                        "target of a GGUF, ~4x fewer CPU-seconds); a --feature-cache holds one kind")
    t.add_argument("--feature-cache", metavar="DIR",
                   help="keep the target's features on disk in DIR (bf16, ~5.8 KB per token for SmolLM2; "
                        "resumable, shared by runs): each sequence's target forward runs once")
    t.add_argument("--cache-features", action="store_true",
                   help="with --distill and --feature-cache: only compute the features of every sequence "
                        "(resumable, progress in DIR/progress.json), do not train")
    t.add_argument("--vocab", choices=["data", "full"], default="data",
                   help="softmax of the loss over the answers' tokens (~3x cheaper steps) or all tokens")
    t.add_argument("--vocab-frequent", type=int, default=0, metavar="K",
                   help="with --vocab data: only the K most frequent answer tokens, each step's labels and "
                        "2048 random others in the loss's softmax (0: every answer token)")
    t.add_argument("--soft", type=float, default=0.0,
                   help="weight of distillation from the target's distribution (its top-k per position)")
    t.add_argument("--soft-top-k", type=int, default=32)
    t.add_argument("--minutes", type=float,
                   help="a wall-clock budget (e.g. a rented GPU's): the learning-rate cosine runs over it instead of "
                        "--steps, and training ends with a save when it is spent")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--held-out", type=int, default=24,
                   help="rows never trained on (smallest key hashes); the periodic tau reads 24 of them")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument("--snapshots", action="store_true",
                   help="keep the draft of every evaluation under OUT/snapshots/step-N (for a learning curve)")
    t.add_argument("--init-from", metavar="DRAFT",
                   help="start from this draft's weights (a folder, or a shipped name such as cpu-trained) "
                        "instead of copies of the target's last layers")


def bar(label: str) -> Progress:
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=err)


def train_command(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.generate_only and not args.distill:
        raise ConfigError("--generate-only makes --distill data", "add --distill DIR")
    if args.gamma is not None and not args.gamma > 0:
        raise ConfigError(f"--gamma {args.gamma}: the loss's position decay must be > 0",
                          "use e.g. 2 (the first positions) or 7 (DFlash's default at block 16)")
    if not 0 <= args.short_blocks <= 1:
        raise ConfigError(f"--short-blocks {args.short_blocks}: a share of the blocks, 0 to 1", "use e.g. 0.5")
    if args.cache_features and not (args.distill and args.feature_cache):
        raise ConfigError("--cache-features fills a feature cache from --distill data",
                          "add --distill DIR --feature-cache DIR")
    if not args.out and not args.generate_only and not args.cache_features:
        raise ConfigError("train-draft needs --out for the trained draft", "add --out DIR")
    check_packing(args.pack, args.accumulate)  # here, before any data is generated or loaded
    target = resolve_target(args.target)
    if args.generate_only and len(args.distill) > 1:
        raise ConfigError("--generate-only extends one --distill store", "give one --distill DIR "
                          "(--skip-answered DIR leaves out another store's prompts)")
    if args.distill:
        rows = distill_rows(target, [Path(d) for d in args.distill], args)
        if args.generate_only:
            return
        if args.cache_features:
            return cache_features(target, rows, args)
    else:
        rows = jsonl_rows(target, Path(args.out), args)
    train_on(target, rows, Path(args.out), args)


def distill_rows(target: Path, folders: list[Path], args: argparse.Namespace) -> list[dict]:
    """--generate-only: make or extend the shards (hours: a background job). Otherwise: train on the
    shards as they are, so that training can start while the data job goes on; rows of several stores carry
    their store's number (`store`), so that each store keeps its own held-out rows (trainer.split_held_out)."""
    if not args.generate_only:
        return load_stores(folders, target, log=lambda line: err.print(line, highlight=False))
    folder = folders[0]
    prompts = None
    if args.skip_answered:
        from .corpus import training_mix
        mix, _ = training_mix(args.mix_seed, turns=args.sharegpt_turns)
        prompts = unanswered(mix, [Path(d) for d in args.skip_answered])
        err.print(f"--skip-answered: {len(mix) - len(prompts)} of the mix's {len(mix)} prompts are answered elsewhere")
    record = generate_shards(target, folder, max_new_tokens=args.max_new_tokens or 256, prompts=prompts,
                             max_prompt_tokens=args.max_prompt_tokens, slots=args.gen_batch_size, seed=args.mix_seed,
                             turns=args.sharegpt_turns, limit=args.prompts, progress=folder / "progress.json",
                             dtype=args.gen_dtype, k_q8=getattr(args, "k_q8", True),
                             log=lambda line: err.print(line, highlight=False, soft_wrap=True))
    err.print(f"self-distillation: {record}", highlight=False, soft_wrap=True)
    return []


def jsonl_rows(target: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    """The first recipe's data: 1600 template/stdlib prompts answered by transformers' generate."""
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else out / "data.jsonl"
    if not args.data:
        prompts = training_prompts(args.prompts or 1600, args.code_fraction, args.seed)
        if len(done_indices(data)) < len(prompts):
            with bar("self-distillation data") as p:
                task = p.add_task("", total=len(prompts))
                generate_responses(target, prompts, data, max_new_tokens=args.max_new_tokens or 200,
                                   batch_size=args.gen_batch_size,
                                   progress=lambda done, total: p.update(task, completed=len(prompts) - total + done))
    return load_rows(data)


def cache_features(target: Path, rows: list[dict], args: argparse.Namespace) -> None:
    """Every sequence's target features into --feature-cache (hours at scale: a background job; rerun to
    resume). The held-out rows are included: the trainer's evaluation reads them too."""
    from hetero_sd.models.config import ArchConfig, read_json
    from .features import FeatureStore, fill
    from .trainer import FeatureCache, feature_layers
    tcfg = ArchConfig.from_dict(read_json(target / "config.json"))
    layer_ids = feature_layers(tcfg.num_hidden_layers, args.layers,
                               init=Path(init_folder(args.init_from)) if args.init_from else None)
    folder = Path(args.feature_cache)
    features = FeatureCache(target, layer_ids, budget_bytes=0, device=args.device, numerics=args.feature_numerics,
                            k_q8=getattr(args, "k_q8", True))
    # the store named as the features are made (an int8 target's q8_0 K cache included), as the trainer opens it
    store = FeatureStore.for_target(folder, target, layer_ids, len(layer_ids) * tcfg.hidden_size, features.kind)
    fill(store, rows, lambda ids: features.compute(ids)[0], progress=folder / "progress.json",
         log=lambda line: err.print(line, highlight=False, soft_wrap=True))


def init_folder(name: str) -> str:
    from ..loading.loader import SHIPPED_DRAFTS, shipped
    folder = (shipped(name) if name in SHIPPED_DRAFTS else None) or Path(name)
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(f"--init-from {name}: no draft folder (config.json) there",
                          "give a draft folder or a shipped draft name such as cpu-trained")
    return str(folder)


def train_on(target: Path, rows: list[dict], out: Path, args: argparse.Namespace) -> None:
    cfg = TrainConfig(block_size=args.block_size, layers=args.layers, steps=args.steps, lr=args.lr,
                      accumulate=args.accumulate, anchors=args.anchors, gamma=args.gamma,
                      short_blocks=args.short_blocks, eval_every=args.eval_every, seed=args.seed,
                      vocab=args.vocab, soft=args.soft, soft_top_k=args.soft_top_k,
                      snapshots=args.snapshots, init=init_folder(args.init_from) if args.init_from else "target",
                      pack=args.pack, device=args.device, autocast=args.autocast, attention=args.attention,
                      attention_group=args.attention_group, ce_chunk=args.ce_chunk,
                      feature_cache=args.feature_cache, held_out=args.held_out, vocab_frequent=args.vocab_frequent,
                      feature_numerics=args.feature_numerics, k_q8=getattr(args, "k_q8", True), minutes=args.minutes)
    err.print(f"training on {len(rows)} sequences ({sum(len(r['response_ids']) for r in rows)} response tokens)")
    with bar("train-draft") as p:
        task = p.add_task("", total=cfg.steps)
        tau = {"v": None}

        def progress(record):
            tau["v"] = record.get("held_out_tau", tau["v"])
            shown = f"loss {record['loss']:.3f}" + (f"  held-out tau {tau['v']:.2f}" if tau["v"] else "")
            p.update(task, completed=record["step"], description=shown)

        train(target, rows, out, cfg, resume=args.resume, progress=progress)
    err.print(f"draft written to {out} (z-lab's config.json + model.safetensors"
              + (", hetero_sd.json beside them" if (out / "hetero_sd.json").is_file() else "")
              + f"; for llama.cpp, vLLM, SGLang, MLX: hetero-sd export-draft {out} --to gguf|zlab|mlx, docs/drafts.md)")
