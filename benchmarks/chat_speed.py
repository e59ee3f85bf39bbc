"""The chat app's speed in a real terminal against `hetero-sd generate` on the same prompt and length.

Each round runs `hetero-sd generate PROMPT` (speculative, then `--autoregressive`) and then `hetero-sd chat`, each
in a detached tmux window (140x40 by default; generate's text streams to it as the chat's does), types the same prompt, waits until the answer has ended (the panel's
`answer` row says `done`), and reads the panel (tok/s, speedup, tau, tokens) from `tmux capture-pane`. Rounds
alternate so a drift of the machine touches both sides alike. Writes JSON with every round, the medians and the
ratios the chat is held to, per round and their medians: its tok/s over generate's, its shown speedup over
generate's spec/AR ratio.

    python benchmarks/chat_speed.py --rounds 3 --json benchmarks/results/chat/chat_speed.json

Needs tmux; run it with nothing else on the machine."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a number is prime."
SESSION = "hetero-sd-chat-speed"
def hetero_sd() -> str:
    here = Path(sys.executable).with_name("hetero-sd")
    return str(here) if here.exists() else "hetero-sd"


def run_generate(prompt: str, tokens: int, extra: list[str], size: tuple[int, int], timeout: float) -> dict:
    """`hetero-sd generate` in the same kind of tmux window as the chat (its text streams to the terminal,
    as a user sees it); its stats read from its --json."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "generation.json"
        command = shlex.join([hetero_sd(), "generate", prompt, "--max-new-tokens", str(tokens), *extra, "--json", str(out)])
        screen = in_window(command, size, timeout, "generate to end")
        if not out.exists():
            raise SystemExit(f"`{command}` wrote no JSON; its last screen:\n{screen}")
        stats = json.loads(out.read_text())["stats"]
    return {"tokens": stats["num_generated_tokens"], "tok_s": stats["tokens_per_s"], "tau": stats["tau"]}


def start_window(command: str, size: tuple[int, int]) -> None:
    tmux("kill-session", "-t", SESSION)
    tmux("new-session", "-d", "-s", SESSION, "-x", str(size[0]), "-y", str(size[1]), command)
    tmux("set-option", "-t", SESSION, "remain-on-exit", "on")  # a command that exits leaves its last screen


def in_window(command: str, size: tuple[int, int], timeout: float, what: str) -> str:
    """Run `command` in a fresh tmux window until it exits; its last screen."""
    start_window(command, size)
    end, screen = time.monotonic() + timeout, ""
    try:
        while time.monotonic() < end:
            screen = tmux("capture-pane", "-p", "-t", SESSION) or screen
            if tmux("display-message", "-p", "-t", SESSION, "#{pane_dead}").strip() == "1":
                return screen
            time.sleep(0.25)
        raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}; the screen:\n{screen}")
    finally:
        tmux("kill-session", "-t", SESSION)


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True).stdout


def panel(screen: str, width: int) -> dict:
    """The side panel's rows as {label: value}, read from the right-hand `width` columns of the screen."""
    rows = {}
    for line in screen.splitlines():
        cell = line[-width:].strip(" │▎▊|")
        m = re.match(r"(tok/s|baseline|speedup|tau|answer)\s+(.+)", cell.strip())
        if m:
            rows[m[1]] = m[2].strip()
    return rows


def number(text: str | None) -> float | None:
    m = re.search(r"[\d.]+", text or "")
    return float(m[0]) if m else None


def run_chat(prompt: str, tokens: int, size: tuple[int, int], timeout: float) -> dict:
    """One answer in a fresh `hetero-sd chat` (the model loads and measures its baseline first)."""
    start_window(f"{shlex.quote(hetero_sd())} chat --max-new-tokens {tokens}", size)
    try:
        wait_for(lambda s: "Ask something" in s, timeout, "the model to load")
        tmux("send-keys", "-t", SESSION, "-l", prompt)
        time.sleep(1.0)  # the keys are typed; the screen is quiet again before the answer starts
        app = int(tmux("display-message", "-p", "-t", SESSION, "#{pane_pid}"))
        server = int(tmux("display-message", "-p", "#{pid}"))
        before = {"screen_thread": cpu_s(app, app), "tmux_server": cpu_s(server, server), "app": cpu_s(app)}
        sent = time.monotonic()
        tmux("send-keys", "-t", SESSION, "Enter")
        screen = wait_for(lambda s: "done" in panel(s, 29).get("answer", ""), timeout, "the answer to end")
        ended = time.monotonic() - sent
        cpu = {"screen_thread": cpu_s(app, app), "tmux_server": cpu_s(server, server), "app": cpu_s(app)}
    finally:
        tmux("kill-session", "-t", SESSION)
    rows = panel(screen, 29)
    return {"tokens": int(number(rows.get("answer")) or 0), "tok_s": number(rows.get("tok/s")),
            "tau": number(rows.get("tau")), "speedup": number(rows.get("speedup")),
            "baseline_tok_s": number(rows.get("baseline")), "enter_to_done_s_polled": round(ended, 2),
            # CPU seconds from Enter until the end was seen: the app's screen thread (its main thread), the
            # whole app (engine included) and the terminal (tmux parsing what the app draws)
            "cpu_s_during_answer": {k: round(cpu[k] - before[k], 3) for k in cpu},
            "panel": rows}


def cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads), from /proc."""
    stat = Path(f"/proc/{pid}" + (f"/task/{tid}" if tid else "") + "/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(ready, timeout: float, what: str) -> str:
    end, screen = time.monotonic() + timeout, ""
    while time.monotonic() < end:
        screen = tmux("capture-pane", "-p", "-t", SESSION)
        if tmux("display-message", "-p", "-t", SESSION, "#{pane_dead}").strip() == "1":
            raise SystemExit(f"hetero-sd chat exited while waiting for {what}; its last screen:\n{screen}")
        if ready(screen):
            return screen
        time.sleep(0.25)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}; the screen:\n{screen}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="140x40", help="the tmux window, COLSxROWS")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default="benchmarks/results/chat/chat_speed.json")
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("error: tmux is not installed\nfix: install it (apt install tmux) and run again")
    size = tuple(int(v) for v in args.size.split("x"))
    rounds = []
    for r in range(args.rounds):
        spec = run_generate(args.prompt, args.max_new_tokens, [], size, args.timeout)
        ar = run_generate(args.prompt, args.max_new_tokens, ["--autoregressive"], size, args.timeout)
        chat = run_chat(args.prompt, args.max_new_tokens, size, args.timeout)
        rounds.append({"generate": spec, "generate_ar": ar, "chat": chat})
        write(args, rounds)  # after every round: a run cut short keeps what it measured
        print(f"round {r + 1}: generate {spec['tok_s']:.1f} tok/s ({spec['tokens']} tokens, tau {spec['tau']:.2f}), "
              f"AR {ar['tok_s']:.1f}; chat {chat['tok_s']} tok/s ({chat['tokens']} tokens, tau {chat['tau']}), "
              f"shown speedup {chat['speedup']}x", flush=True)
    doc = write(args, rounds)
    print(f"medians of the rounds' ratios: chat/generate tok/s {doc['chat_over_generate']:.2f}; shown speedup over "
          f"generate's spec/AR {doc['shown_speedup_over_generate_speedup']:.2f}; {args.json}")


def summary(rounds: list[dict]) -> dict:
    """Each round's ratios (its chat against its own generate runs, minutes apart at most) and their medians,
    the figures the chat is held to; the medians of the raw rates beside them."""
    def med(values) -> float:
        return statistics.median(values)

    per_round = [{"chat_over_generate": r["chat"]["tok_s"] / r["generate"]["tok_s"],
                  "generate_speedup": r["generate"]["tok_s"] / r["generate_ar"]["tok_s"],
                  "shown_speedup_over_generate_speedup":
                      r["chat"]["speedup"] / (r["generate"]["tok_s"] / r["generate_ar"]["tok_s"])} for r in rounds]
    return {
        "per_round": per_round,
        "chat_over_generate": med(p["chat_over_generate"] for p in per_round),
        "shown_speedup_over_generate_speedup": med(p["shown_speedup_over_generate_speedup"] for p in per_round),
        "median": {"generate_tok_s": med(r["generate"]["tok_s"] for r in rounds),
                   "generate_ar_tok_s": med(r["generate_ar"]["tok_s"] for r in rounds),
                   "chat_tok_s": med(r["chat"]["tok_s"] for r in rounds),
                   "chat_speedup": med(r["chat"]["speedup"] for r in rounds),
                   "chat_baseline_tok_s": med(r["chat"]["baseline_tok_s"] for r in rounds),
                   "generate_speedup": med(p["generate_speedup"] for p in per_round)},
    }


def write(args, rounds: list[dict]) -> dict:
    doc = {
        "what": "hetero-sd chat's shown speed in tmux against hetero-sd generate in tmux, same prompt and length",
        "command": " ".join(["python", "benchmarks/chat_speed.py", *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "window": args.size,
        "rounds": rounds, **summary(rounds),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def machine() -> dict:
    from hetero_sd.bench.runner import machine as runner_machine
    from hetero_sd.decoding.costs import capability
    return runner_machine() | {"capability": capability()}


if __name__ == "__main__":
    main()
