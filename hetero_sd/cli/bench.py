"""`hetero-sd bench` on the command line.

One invocation runs a matrix: every placement (target device / draft device) x every temperature is a
full baseline-vs-DFlash run on the same prompts (bench.run_bench); the peers and the floor run once,
after the first greedy run. A progress bar follows the prompts. The JSON is replaced atomically after
every finished prompt (the run in progress under "in_progress") and every finished run, so a kill
loses at most the prompt in flight. Ctrl-C or SIGTERM stops the matrix there: the prompts that
finished stay in the JSON, marked `"interrupted": true`, and the exit status is 130 (143 for SIGTERM)."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetero_sd import validate
from .common import block_arg, err, interrupted_status, load_runtime, write_json
from hetero_sd.errors import HeteroSDError, OutputPathError


def placements(args) -> list[tuple[str, str | None]]:
    """--placements "cpu/cpu,cpu/ane-sim,mlx" (target/draft; one name puts both there)."""
    if not args.placements:
        return [(args.target_device, args.draft_device)]
    out = []
    for item in (p.strip() for p in args.placements.split(",") if p.strip()):
        target, _, draft = item.partition("/")
        if not target:
            raise HeteroSDError(f"placement {item!r} names no target device",
                                "write TARGET/DRAFT, e.g. cpu/ane-sim, or one device for both")
        out.append((target, draft or None))
    return out


def temperatures(value: str) -> list[float]:
    try:
        return [float(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of temperatures") from None


def label(res: dict) -> str:
    m = res["models"]
    return f"{m['target_device']}/{m['draft_device']} T={res['settings']['temperature']:g}"


class Saver:
    """Writes what has finished, as it finishes: a one-run bench as its result, a matrix (or a run not
    finished yet) as {"runs": [...], "matrix": [...], "interrupted": ..., "in_progress": {...}}, where
    in_progress holds the finished prompt rows of the run under way."""

    def __init__(self, path: str | None, planned: int):
        self.path, self.planned, self.runs, self.interrupted = path, planned, [], False
        self.current: dict | None = None
        self.failed: OutputPathError | None = None

    def start(self, rt, temperature: float) -> None:
        self.current = {"models": rt.info, "settings": {"temperature": temperature}, "prompts": []}

    def prompt_done(self, row: dict) -> None:
        self.current["prompts"].append({k: v for k, v in row.items() if k != "baseline_ids"})
        self.save(quiet=True)

    def add(self, res: dict) -> None:
        self.runs.append(res)
        self.current = None
        self.save()

    def document(self) -> dict:
        if self.planned == 1 and self.runs:
            return self.runs[0]
        from hetero_sd.bench.runner import machine

        doc = {"machine": self.runs[0]["machine"] if self.runs else machine(), "command": " ".join(sys.argv),
               "interrupted": self.interrupted, "planned_runs": self.planned, "runs": self.runs,
               "matrix": [matrix_row(r) for r in self.runs]}
        return doc | ({"in_progress": self.current} if self.current else {})

    def save(self, quiet: bool = False) -> None:
        """A file that cannot be written any more (disk full, folder removed) is reported once; the
        bench goes on and its tables are still printed."""
        if not self.path or (not self.runs and not self.current) or self.failed:
            return
        try:
            write_json(self.path, self.document(), quiet=quiet)
        except OutputPathError as e:
            self.failed = e
            err.print(f"[bold red]error:[/] {e.problem}\n[bold]fix:[/] {e.fix}", highlight=False)


def matrix_row(res: dict) -> dict:
    m = res["models"]
    return {"target_device": m["target_device"], "draft_device": m["draft_device"],
            "temperature": res["settings"]["temperature"], "prompts": len(res["prompts"]),
            "baseline_tokens_per_s": res["baseline_tokens_per_s"], "spec_tokens_per_s": res["spec_tokens_per_s"],
            "speedup": res["speedup"], "tau": res["tau"], "lossless": res["lossless"]}


def bar() -> Progress:
    return Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=err, transient=False)


# Under `match` a seeded speculative answer is plain decoding's own sample; under `rejection` it is another one
OTHER_SAMPLES = ("under --rule rejection at T>0 the speculative answers are other samples than plain decoding's "
                 "(--rule match keeps them the same): each row compares two texts of different lengths and "
                 "difficulty; the speedup of one --seed can sit a few percent off, run several")


def bench_command(args) -> int:
    if args.costs:
        return run_costs(args)
    from hetero_sd.bench.runner import run_bench
    from hetero_sd.prompts import load_prompts

    from hetero_sd.runtime import check_schedule

    prompts = load_prompts(args.prompts, args.dataset, args.limit)
    schedules = [check_schedule(s.strip()) for s in args.schedule.split(",") if s.strip()]
    blocks = [block_arg(b.strip()) for b in args.blocks.split(",")] if args.blocks else (None,)
    where, temps = placements(args), args.temperature
    saver, timelines, peers_done = Saver(args.json, len(where) * len(temps)), [], False
    with bar() as progress:
        task = progress.add_task("", total=len(where) * len(temps) * len(prompts))
        try:
            for target_device, draft_device in where:
                rt = load_runtime(args, schedules, target_device, draft_device)
                check_blocks(blocks, rt)
                for note in rt.notes:
                    progress.console.print(f"[yellow]note:[/] {note}")
                for temperature in temps:
                    other_samples = temperature > 0 and args.rule == "rejection"
                    if other_samples:
                        progress.console.print(f"[yellow]note:[/] {OTHER_SAMPLES}")
                    saver.start(rt, temperature)
                    tick = ticker(progress, task, len(prompts), f"{rt.info['target_device']}/{rt.info['draft_device']} "
                                                                f"T={temperature:g}", saver)
                    res = run_bench(rt, prompts, max_new_tokens=args.max_new_tokens, temperature=temperature,
                                    rule=args.rule, seed=args.seed or 0, schedules=schedules, blocks=blocks,
                                    progress=tick)
                    if other_samples:
                        res["notes"] = res["notes"] + [OTHER_SAMPLES]
                    timelines += [(f"{label(res)} {name}", t) for name, t in res.pop("timelines")]
                    saver.add(res)  # (before the peers: a bench stopped while they run keeps its own rows)
                    if not res.get("interrupted") and temperature == 0 and not peers_done:
                        add_peers_and_floor(args, rt, prompts, res, progress)  # greedy peers: once, on a T=0 run
                        peers_done = True
                        saver.save()
                    if res.get("interrupted"):
                        raise KeyboardInterrupt
                rt.close()
        except KeyboardInterrupt:
            if not saver.runs:
                raise
            saver.interrupted = True
            saver.save()
    report(saver)
    if args.trace:
        from hetero_sd.decoding.timeline import chrome_trace
        write_json(args.trace, chrome_trace(timelines))
    if saver.interrupted:
        err.print(f"[yellow]interrupted:[/] {sum(len(r['prompts']) for r in saver.runs)} finished prompt rows "
                  + (f"kept in {args.json}" if args.json and not saver.failed else
                     "shown above (pass --json to keep them)"))
        return interrupted_status()
    unrun = [f for r in saver.runs for f in r.get("peers_failed") or []]
    if unrun:  # the measurements are kept (shown, and in --json); the comparison is not whole
        err.print(f"[red]error:[/] peer(s) asked for with --peers did not run: {escape('; '.join(unrun))}")
    return 2 if saver.failed or unrun else 0


def check_blocks(blocks, rt) -> None:
    """--blocks against the loaded draft, before the first prompt runs."""
    if rt.draft is not None:
        for b in blocks:
            if b is not None:
                validate.block(b, rt.draft.block_size)


def ticker(progress: Progress, task, total: int, where: str, saver: Saver):
    def tick(r: dict) -> None:
        saver.prompt_done(r)
        progress.advance(task)
        if "tau" in r:
            progress.update(task, description=f"{where}: prompt {r['index'] + 1}/{total}, tau {r['tau']:.2f}")
            progress.console.print(f"[dim]{where} prompt {r['index'] + 1}/{total}: base "
                                   f"{r['baseline_tokens_per_s']:.1f} tok/s, spec {r['spec_tokens_per_s']:.1f} tok/s, "
                                   f"tau {r['tau']:.2f}, identical {r['identical']}[/]")
    return tick


def report(saver: Saver) -> None:
    if saver.planned == 1:
        print_bench(saver.runs[0])
        return
    t = Table(title="hetero-sd bench: every placement and temperature on the same prompts")
    for col in ("target/draft", "T", "prompts", "base tok/s", "spec tok/s", "speedup", "tau", "lossless"):
        t.add_column(col, justify="right")
    for r in saver.runs:
        m = matrix_row(r)
        t.add_row(f"{m['target_device']}/{m['draft_device']}", f"{m['temperature']:g}", str(m["prompts"]),
                  f"{m['baseline_tokens_per_s']:.1f}", f"{m['spec_tokens_per_s']:.1f}", f"{m['speedup']:.2f}x",
                  f"{m['tau']:.2f}", str(m["lossless"]))
    Console().print(t)
    for r in saver.runs:
        print_details(r, f"schedules, {label(r)}")


def print_bench(res: dict) -> None:
    fmt = res["models"].get("draft_format") or "dflash"
    t = Table(title=f"hetero-sd bench: autoregressive baseline vs DFlash speculative decoding (draft: {fmt})")
    for col in ("#", "category", "tokens", "base tok/s", "spec tok/s", "speedup", "tau", "identical", "loops"):
        t.add_column(col, justify="right")
    for r in res["prompts"]:
        if "spec_tokens" not in r:  # only pipelined runs: per-prompt figures are in the schedule table
            t.add_row(str(r["index"]), r["category"], str(r["baseline_tokens"]), f"{r['baseline_tokens_per_s']:.1f}")
            continue
        t.add_row(str(r["index"]), r["category"], str(r["spec_tokens"]), f"{r['baseline_tokens_per_s']:.1f}",
                  f"{r['spec_tokens_per_s']:.1f}", f"{r['spec_tokens_per_s'] / r['baseline_tokens_per_s']:.2f}x",
                  f"{r['tau']:.2f}", str(r["identical"]), pct(r.get("loop_share")))
    t.add_row("all", "", "", f"{res['baseline_tokens_per_s']:.1f}", f"{res['spec_tokens_per_s']:.1f}",
              f"{res['speedup']:.2f}x", f"{res['tau']:.2f}", str(res["lossless"]), pct(res.get("loops", {}).get("loop_share")),
              style="bold")
    Console().print(t)
    if res.get("loops", {}).get("tau_loop_free") is not None:
        lp = res["loops"]
        Console().print(f"loops (repeats of {lp['ngram']} tokens): {lp['loop_share']:.0%} of the tokens; loop-free part: "
                        f"tau {lp['tau_loop_free']:.2f} (all {lp['tau_all']:.2f}), speedup {lp['speedup_loop_free']:.2f}x")
    lk = (res.get("schedules") or [{}])[0].get("lookup") or {}
    if lk.get("weight"):
        Console().print(f"context lookup (weight {lk['weight']}): it changed {lk['drafts_changed']} proposals; "
                        f"{lk['blocks']} of the {lk['verified_blocks']} verified blocks were its guesses alone (no draft pass)")
    print_details(res, "schedules (same prompts, same process)")


def print_details(res: dict, schedules_title: str) -> None:
    """What a run has beyond its main row: schedules and block settings, peers and floor, drift."""
    if len(res["schedules"]) > 1 or res["schedules"][0]["schedule"] != "sequential":  # also one row per block
        print_schedules(res, schedules_title)
    if res.get("peers") or res.get("floor"):
        print_peers(res)
    if res.get("drift"):
        Console().print(drift_line(res["drift"]))


def drift_line(d: dict) -> str:
    """The drift pass's figures, or what stopped it from measuring any (never a mean over no block)."""
    if d["cosine"] is None:
        return f"drift of {d['device']} vs the float32 draft: {d['note']}"
    line = (f"drift of {d['device']} vs the float32 draft over {d['blocks']} blocks ({d['pass']}): "
            f"cosine {d['cosine']:.5f} (min {d['cosine_min']:.5f}), top-1 agreement {d['top1_agreement']:.3f}, "
            f"KL {d['kl']:.2e}")
    if d.get("tau_ratio") is not None:
        line += f", tau ratio {d['tau_ratio']:.3f} ({d['tau_device']:.2f} / {d['tau_reference']:.2f})"
    row = d.get("in_row")
    if row is not None:
        line += (f"; in the row itself: {row['blocks']} blocks" if row["blocks"] else
                 "; in the row itself no draft block ran (the controller decoded plainly)")
    return line


def add_peers_and_floor(args, rt, prompts, res: dict, progress: Progress) -> None:
    import os

    from hetero_sd.backends.base import weights_of
    from hetero_sd.bench.floor import floor_report
    from hetero_sd.bench.peer_row import failures
    from hetero_sd.bench.peers import PeersStopped, peer_names, run_peers

    names = peer_names(args.peers)
    if names:
        ids = [rt.encode(p.text)[0] for p in prompts]
        task = progress.add_task("peers", total=len(names) * len(ids))
        try:
            rows = run_peers(names, rt, ids, args.max_new_tokens, tick=lambda name: progress.update(
                task, advance=1, description=f"peer {name}"), draft=args.peer_draft, ours=res["prompts"])
        except PeersStopped as e:  # the peers that finished go into the run's rows before the bench stops
            res["peers"] = [r.to_dict(res["spec_tokens_per_s"], res["baseline_tokens_per_s"]) for r in e.rows]
            raise
        res["peers"] = [r.to_dict(res["spec_tokens_per_s"], res["baseline_tokens_per_s"]) for r in rows]
        res["peers_failed"] = failures(res["peers"], args.peers)  # asked for by name and not run: the run fails
        for r in rows:
            if r.skipped:
                progress.console.print(f"[{'red' if res['peers_failed'] else 'yellow'}]peer {r.name} skipped:[/] {r.note}")
    if args.floor or names:
        systems = {"hetero-sd autoregressive": res["baseline_tokens_per_s"], "hetero-sd DFlash": res["spec_tokens_per_s"]}
        systems |= {r["name"]: r["tokens_per_s"] for r in res.get("peers", []) if not r["skipped"]}
        gguf = rt.info.get("gguf")
        context = max(len(rt.encode(p.text)[0]) for p in prompts) + args.max_new_tokens // 2
        if weights_of(rt.target) is not None and rt.target.device == "cpu":
            res["floor"] = floor_report(rt.target, context, systems, os.path.getsize(gguf) if gguf else None)
        elif args.floor:
            progress.console.print(f"[yellow]note: --floor is the CPU's (its read bandwidth and a torch target's "
                                   f"weights); the target on {rt.target.device} has its floors in --costs[/]")


def print_peers(res: dict) -> None:
    """Every system's tok/s as a ratio to ours (theirs / ours), tau where reported, loop share; the
    notes (what each ran, what it reads, why it was skipped) below the table."""
    failed = res.get("peers_failed") or []
    t = Table(title=(f"[bold red]ERROR: {len(failed)} peer(s) asked for did not run: "
                     f"{escape('; '.join(failed))}[/]\n" if failed else "")
              + "peers (same prompts, same run; ratios are theirs / ours)")
    for col in ("system", "tok/s", "tau", "vs DFlash", "vs AR", "loops", "of floor"):
        t.add_column(col, justify="right")
    fractions = res.get("floor", {}).get("fraction_of_floor", {})
    base, spec, loops = res["baseline_tokens_per_s"], res["spec_tokens_per_s"], res.get("loops", {})
    own = [("hetero-sd autoregressive", base, None), ("hetero-sd DFlash", spec, res["tau"])]
    for name, tps, tau in own:
        t.add_row(name, f"{tps:.1f}", num(tau), f"{tps / spec:.2f}x", f"{tps / base:.2f}x", pct(loops.get("loop_share")),
                  pct(fractions.get(name)))
    notes = []
    for r in res.get("peers", []):
        if r["skipped"]:
            t.add_row(r["name"], "-", "-", "-", "-", "-", "-")
            notes.append(f"[yellow]{r['name']} skipped:[/] {escape(r['note'])}")
            continue
        t.add_row(r["name"], f"{r['tokens_per_s']:.1f}", num(r.get("tau")), f"{r['ratio_to_spec']:.2f}x",
                  f"{r['ratio_to_autoregressive']:.2f}x", pct(r.get("loop_share")), pct(fractions.get(r["name"])))
        notes.append(escape(f"{r['name']}: {r['note']}; reads {r['weights']}{identical(r)}"))
    console = Console()
    console.print(t)
    for line in notes:
        console.print(f"  {line}", markup=True, highlight=False)


def num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def identical(peer: dict) -> str:
    """z-lab's reference at T=0: identical to our tokens on every prompt, or where it first differs."""
    if "identical" not in peer:
        return ""
    if peer["identical"]:
        text = "; tokens identical to ours on every prompt"
    else:
        diffs = [f"#{i}@{p['first_divergence']}" for i, p in enumerate(peer["prompts"]) if not p.get("identical", True)]
        text = f"; tokens differ from ours (prompt@token): {', '.join(diffs)}"
    steps = [f"#{i}@{p['acceptance_differs_at_token']}/{p['tokens']}" for i, p in enumerate(peer["prompts"])
             if p.get("acceptance_differs_at_token") is not None]
    return text + (f"; acceptance lengths differ (prompt@token/tokens): {', '.join(steps)}" if steps else "")


def pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def print_schedules(res: dict, title: str) -> None:
    t = Table(title=title)
    for col in ("schedule", "block", "wall s", "tok/s", "speedup", "tau", "from blocks", "overlap", "pre-draft hits",
                "lossless"):
        t.add_column(col, justify="right")
    for r in res["schedules"]:
        hits = "" if r["predraft_hit_rate"] is None else f"{r['predraft_hit_rate']:.0%}"
        modes = r["tokens_by_mode"]
        t.add_row(r["schedule"], str(r["block"]), f"{r['wall_s']:.1f}", f"{r['spec_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                  f"{r['tau']:.2f}", pct(modes["speculative"] / max(sum(modes.values()), 1)),
                  f"{r['overlap_fraction']:.0%}", hits, str(r["lossless"]))
    Console().print(t)


def run_costs(args) -> int:
    """`bench --costs`: the cost probe on the first placement, as a table and the JSON's `costs` object."""
    import sys

    from hetero_sd.bench.runner import machine
    from hetero_sd.decoding.costs import measure_costs

    target_device, draft_device = placements(args)[0]
    rt = load_runtime(args, ["sequential"], target_device, draft_device)
    for note in rt.notes:
        err.print(f"[yellow]note:[/] {note}")
    err.print("[dim]measuring costs (warm-up, then medians)...[/]")
    costs = measure_costs(rt.target, rt.draft, machine=True)
    print_costs(costs)
    if args.json:
        write_json(args.json, {"machine": machine(), "models": rt.info, "command": " ".join(sys.argv),
                               "costs": costs.to_json()})
    rt.close()
    return 0


def print_costs(costs) -> None:
    where = f"{costs.device} (host: {costs.cpu})" if costs.device else f"{costs.cpu}, {costs.threads} threads"
    t = Table(title=f"costs on {where}, {costs.dtype}, context {costs.context}")
    for col in ("call", "ms", "x decode step", "floor ms", "x floor"):
        t.add_column(col, justify="right")
    floors = costs.floors_s or {}

    def row(name: str, seconds: float, floor: float | None) -> None:
        t.add_row(name, f"{seconds * 1e3:.2f}", f"{seconds / costs.decode_s:.2f}",
                  "-" if floor is None else f"{floor * 1e3:.2f}", "-" if not floor else f"{seconds / floor:.2f}")

    row("decode step", costs.decode_s, floors.get("decode"))
    for k, s in costs.verify_s.items():
        row(f"verify k={k}", s, floors.get("verify", {}).get(k))
    for b, s in costs.draft_s.items():
        row(f"draft b={b}", s, floors.get("draft", {}).get(b))
    Console().print(t)
    if costs.peak_gflops:
        kernels = "".join(f", {name}'s int8-row kernel {gops:.0f} GOPS" for name, gops in costs.kernel_peak_gops.items())
        Console().print(f"{costs.device or 'CPU'} matmul peak {costs.peak_gflops:.0f} GFLOPS{kernels}, "
                        f"{'copy' if costs.device and costs.device != 'MLX' else 'read'} bandwidth {costs.bandwidth_gbs:.1f} GB/s; floor = max(bytes read / bandwidth, flops / the model's own kernel peak)")
    for note in costs.notes:
        err.print(f"[yellow]note:[/] {note}")
