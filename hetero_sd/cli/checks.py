"""Command-line values that only some commands take, checked before any model loads: every list flag
of `bench` (an empty item or list is an error, never "run nothing"), its peers and dataset, and
compile-ane's window. Each failure names the flag, the value and the fix (exit status 2)."""

from __future__ import annotations

from hetero_sd.errors import InvalidArgumentError

SCHEDULES = ("sequential", "overlap", "pipeline")
MAX_WINDOW = 32768  # compile-ane: positions the package takes (a fixed input shape)


def items(flag: str, value: str, example: str) -> list[str]:
    """A comma-separated list with no empty item and at least one."""
    parts = [p.strip() for p in value.split(",")]
    if not value.strip() or any(not p for p in parts):
        raise InvalidArgumentError(f"{flag} {value!r} has an empty item",
                                   f"give a comma-separated list without empty items, e.g. {flag} {example}")
    return parts


def bench_args(args) -> None:
    if args.max_new_tokens < 1:
        raise InvalidArgumentError(f"--max-new-tokens must be >= 1 for bench, got {args.max_new_tokens}",
                                   "pass --max-new-tokens 64 (a bench compares generations of that length)")
    if not args.temperature:
        raise InvalidArgumentError("--temperature names no temperature", "give one or more, e.g. --temperature 0,1")
    for s in items("--schedule", args.schedule, "sequential,overlap"):
        if s not in SCHEDULES:
            raise InvalidArgumentError(f"unknown schedule {s!r} in --schedule", f"use some of {', '.join(SCHEDULES)}")
    if args.blocks is not None:
        for b in items("--blocks", args.blocks, "16,8,auto"):
            if b not in ("auto", "fixed") and not b.isdigit():
                raise InvalidArgumentError(f"--blocks {b!r} is neither a block size nor 'auto' or 'fixed'",
                                           "give sizes and settings, e.g. --blocks 16,8,auto")
            if b.isdigit() and int(b) < 2:
                raise InvalidArgumentError(f"--blocks {b} leaves no room for drafts", "use block sizes >= 2")
    if args.placements is not None:
        items("--placements", args.placements, "cpu/cpu,cpu/ane-sim")
    if args.dataset is not None:
        items("--dataset", args.dataset, "chat,math")
    if args.draft_device is not None and not args.draft_device.strip():
        raise InvalidArgumentError("--draft-device is empty", "name a device (hetero-sd devices), or leave it out")
    if args.peers is not None:
        from hetero_sd.bench.peers import peer_names

        items("--peers", args.peers, "transformers,llama.cpp")
        peer_names(args.peers)  # an unknown name is refused now, not after the whole run
    if args.prompts is not None and args.dataset is not None:
        raise InvalidArgumentError(f"--prompts {args.prompts} and --dataset {args.dataset} both name the prompts",
                                   "give one of them (several built-in sets: --dataset chat,math)")
    if args.costs:
        costs_only(args)


# bench's flags that only a bench run reads: with --costs (the cost probe alone) they would be ignored
RUN_FLAGS = (("blocks", "--blocks"), ("prompts", "--prompts"), ("dataset", "--dataset"), ("limit", "--limit"),
             ("peers", "--peers"), ("peer_draft", "--peer-draft"), ("trace", "--trace"), ("floor", "--floor"))


def costs_only(args) -> None:
    given = [flag for name, flag in RUN_FLAGS if getattr(args, name) not in (None, False)]
    if args.schedule.strip() != "sequential":
        given.append("--schedule")
    if args.temperature != [0.0]:
        given.append("--temperature")
    if args.placements is not None and len(items("--placements", args.placements, "cpu/cpu")) > 1:
        given.append("--placements (more than one)")
    if given:
        raise InvalidArgumentError(f"--costs runs the cost probe alone, so {', '.join(given)} would be ignored",
                                   f"drop {', '.join(g.split(' ')[0] for g in given)}, or drop --costs for a bench run")


def window(value: int) -> int:
    if value < 1 or value > MAX_WINDOW:
        raise InvalidArgumentError(f"--window must be from 1 to {MAX_WINDOW}, got {value}",
                                   "pass the context positions the package takes, e.g. --window 512")
    return value


def at_least(flag: str, value, minimum: int, fix: str) -> None:
    if value is not None and value < minimum:
        raise InvalidArgumentError(f"{flag} must be >= {minimum}, got {value}", fix)


# train-draft's whole-number flags: (flag, the least value, the fix named in the error)
TRAIN_MINIMUMS = (
    ("--block-size", 2, "pass --block-size 16 (an anchor and at least one draft)"),
    ("--layers", 1, "pass --layers 2 (draft layers)"),
    ("--steps", 1, "pass --steps 1000 (optimizer steps)"),
    ("--accumulate", 1, "pass --accumulate 4 (sequences per optimizer step)"),
    ("--pack", 1, "pass --pack 1 (sequences per forward)"),
    ("--eval-every", 1, "pass --eval-every 100 (steps between evaluations)"),
    ("--anchors", 0, "pass --anchors 0 (every response token) or a count of blocks"),
    ("--prompts", 1, "pass --prompts 1600 (or leave it unset)"),
    ("--max-new-tokens", 1, "pass --max-new-tokens 200 (or leave it unset)"),
    ("--gen-batch-size", 1, "pass --gen-batch-size 48"),
    ("--max-prompt-tokens", 1, "pass --max-prompt-tokens 384"),
    ("--soft-top-k", 1, "pass --soft-top-k 32"),
    ("--attention-group", 0, "pass --attention-group 0 (the device's default) or a count of blocks"),
    ("--ce-chunk", 0, "pass --ce-chunk 0 (the device's default) or a count of rows"))


def train_args(args) -> None:
    """train-draft's numbers, data file and output folder, before any target is loaded or data made."""
    import math

    from hetero_sd import validate

    for flag, minimum, fix in TRAIN_MINIMUMS:
        at_least(flag, getattr(args, flag[2:].replace("-", "_")), minimum, fix)
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise InvalidArgumentError(f"--lr must be a finite number > 0, got {args.lr}", "pass --lr 6e-4")
    if not (math.isfinite(args.soft) and args.soft >= 0):
        raise InvalidArgumentError(f"--soft must be a finite number >= 0, got {args.soft}", "pass --soft 0 or e.g. 0.5")
    if args.minutes is not None and not (math.isfinite(args.minutes) and args.minutes > 0):
        raise InvalidArgumentError(f"--minutes must be a finite number > 0, got {args.minutes}", "pass e.g. --minutes 7")
    if not 0 <= args.code_fraction <= 1:
        raise InvalidArgumentError(f"--code-fraction must be in [0, 1], got {args.code_fraction}", "pass e.g. 0.5")
    try:
        validate.threads(args.threads)
    except InvalidArgumentError as e:
        raise InvalidArgumentError("--" + e.problem, e.fix.replace("pass", "pass --threads", 1)) from None
    train_device(args)
    if args.out:
        out_folder(args.out)
    if args.data:
        data_file(args.data)


def train_device(args) -> None:
    """--device (and --autocast) by the trainer's own rule, before any target loads or data is generated."""
    from hetero_sd.train.trainer import train_device as check

    check(args.device, args.autocast)


def out_folder(path: str) -> None:
    import os
    from pathlib import Path

    from hetero_sd.errors import OutputPathError

    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"--out {out} is a file, not a folder", "give --out a folder (it is created if missing)")
    existing = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    if not os.access(existing, os.W_OK):
        raise OutputPathError(f"--out {out} cannot be written ({existing} is read-only or not yours)",
                              "give --out a folder you can write to")


def data_file(path: str) -> None:
    """A JSONL of {"prompt_ids": [...], "response_ids": [...]} rows of token ids (>= 0; the vocabulary is
    checked against the target when it loads)."""
    import json
    from pathlib import Path

    from hetero_sd.errors import ConfigError

    source = Path(path).expanduser()
    if not source.is_file():
        raise ConfigError(f"--data {source} is not a file", "give the JSONL written by a first train-draft run")
    for n, line in enumerate(source.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--data {source}:{n} is not JSON ({e.msg})", "write one JSON object per line") from None
        for key in ("prompt_ids", "response_ids"):
            ids = row.get(key) if isinstance(row, dict) else None
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in ids):
                raise ConfigError(f"--data {source}:{n}: {key!r} is not a list of token ids",
                                  'write rows like {"prompt_ids": [1, 2], "response_ids": [3, 4]}')


def train_vocab(data: str, target_folder) -> None:
    """Token ids of --data against the target's vocabulary (after the target is resolved)."""
    import json
    from pathlib import Path

    from hetero_sd.errors import ConfigError

    config = Path(target_folder) / "config.json"
    if not config.is_file():
        return
    vocab = json.loads(config.read_text()).get("vocab_size")
    if not isinstance(vocab, int):
        return
    for n, line in enumerate(Path(data).expanduser().read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            bad = [t for t in row["prompt_ids"] + row["response_ids"] if t >= vocab]
            if bad:
                raise ConfigError(f"--data {data}:{n}: token id {bad[0]} is outside the target's vocabulary [0, {vocab})",
                                  "make the data with this target's tokenizer")
