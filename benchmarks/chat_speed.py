"""The chat app's speed in a real terminal against `hetero-sd generate` on the same prompt and length.

Each round runs `hetero-sd generate PROMPT` (speculative, then `--autoregressive`) and then `hetero-sd chat` in a
detached tmux window (140x40 by default), types the same prompt, waits until the answer has ended (the panel's
`answer` row says `done`), and reads the panel (tok/s, speedup, tau, tokens) from `tmux capture-pane`. Rounds
alternate so a drift of the machine touches both sides alike. Writes JSON with every round, the medians and the
ratios the chat is held to: its tok/s over generate's, its shown speedup over generate's spec/AR ratio.

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
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a number is prime."
SESSION = "hetero-sd-chat-speed"
GENERATE_LINE = re.compile(r"^(\d+) tokens, ([\d.]+) tok/s(?:, tau ([\d.]+))?", re.M)


def hetero_sd() -> str:
    here = Path(sys.executable).with_name("hetero-sd")
    return str(here) if here.exists() else "hetero-sd"


def run_generate(prompt: str, tokens: int, extra: list[str]) -> dict:
    out = subprocess.run([hetero_sd(), "generate", prompt, "--max-new-tokens", str(tokens), *extra],
                         capture_output=True, text=True, check=True)
    m = GENERATE_LINE.search(out.stdout + out.stderr)
    if m is None:
        raise SystemExit(f"no speed line in `hetero-sd generate` output:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return {"tokens": int(m[1]), "tok_s": float(m[2]), "tau": float(m[3]) if m[3] else None}


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
    tmux("kill-session", "-t", SESSION)
    command = f"{shlex.quote(hetero_sd())} chat --max-new-tokens {tokens}"
    tmux("new-session", "-d", "-s", SESSION, "-x", str(size[0]), "-y", str(size[1]), command)
    tmux("set-option", "-t", SESSION, "remain-on-exit", "on")  # an app that exits leaves its last screen
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
        spec = run_generate(args.prompt, args.max_new_tokens, [])
        ar = run_generate(args.prompt, args.max_new_tokens, ["--autoregressive"])
        chat = run_chat(args.prompt, args.max_new_tokens, size, args.timeout)
        rounds.append({"generate": spec, "generate_ar": ar, "chat": chat})
        write(args, rounds)  # after every round: a run cut short keeps what it measured
        print(f"round {r + 1}: generate {spec['tok_s']:.1f} tok/s ({spec['tokens']} tokens, tau {spec['tau']}), "
              f"AR {ar['tok_s']:.1f}; chat {chat['tok_s']} tok/s ({chat['tokens']} tokens, tau {chat['tau']}), "
              f"shown speedup {chat['speedup']}x", flush=True)
    doc = write(args, rounds)
    print(f"chat/generate tok/s {doc['chat_over_generate']:.2f}x; shown speedup {doc['median']['chat_speedup']:.2f}x "
          f"vs generate's {doc['median']['generate_speedup']:.2f}x ({doc['shown_speedup_over_generate_speedup']:.2f}); "
          f"{args.json}")


def write(args, rounds: list[dict]) -> dict:
    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    generate_ratio = med("generate", "tok_s") / med("generate_ar", "tok_s")
    doc = {
        "what": "hetero-sd chat's shown speed in tmux against hetero-sd generate, same prompt and length",
        "command": " ".join(["python", "benchmarks/chat_speed.py", *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "window": args.size,
        "rounds": rounds,
        "median": {"generate_tok_s": med("generate", "tok_s"), "generate_ar_tok_s": med("generate_ar", "tok_s"),
                   "chat_tok_s": med("chat", "tok_s"), "chat_speedup": med("chat", "speedup"),
                   "generate_speedup": generate_ratio},
        "chat_over_generate": med("chat", "tok_s") / med("generate", "tok_s"),
        "shown_speedup_over_generate_speedup": med("chat", "speedup") / generate_ratio,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def machine() -> dict:
    from hetero_sd.bench.runner import machine as runner_machine
    return runner_machine()


if __name__ == "__main__":
    main()
