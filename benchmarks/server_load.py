"""Load test of `hetero-sd serve`: N clients, each making R chat requests one after another, all at once;
every response checked complete (a finish reason, usage). Writes JSON: requests, errors, latency and
time-to-first-token percentiles (streamed requests), tokens, wall time, the machine and its load.

    python benchmarks/server_load.py --json benchmarks/results/serving/server_load.json            # spawns the server
    python benchmarks/server_load.py --url http://127.0.0.1:8000 --clients 16 --requests 4  # an existing one

Without --url it starts `hetero-sd serve` (default model and draft, or --serve-args) on a free port,
waits for /health, runs the load, then stops it with SIGTERM and records its exit status."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

QUESTIONS = ["Name three colours.", "What is 7 times 6?", "Write a haiku about rain.", "Say hello in French.",
             "What is the capital of Italy?", "List two prime numbers.", "Explain what a cat is.", "Count to five."]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def one_request(url: str, n: int, max_tokens: int, timeout: float) -> dict:
    """A streamed chat request: time to the first content chunk, total latency, completion checks."""
    body = {"messages": [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    began, first, finish, usage, error = time.perf_counter(), None, None, None, None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return {"error": f"HTTP {r.status_code}: {r.text[:200]}", "latency_s": time.perf_counter() - began}
            done = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                for c in chunk.get("choices", []):
                    if c["delta"].get("content") and first is None:
                        first = time.perf_counter() - began
                    finish = c.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
            if not done or finish is None or usage is None:
                error = error or "incomplete stream (no [DONE], finish reason or usage)"
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    out = {"latency_s": time.perf_counter() - began, "ttft_s": first, "finish_reason": finish,
           "completion_tokens": usage and usage["completion_tokens"]}
    return out | ({"error": error} if error else {})


def run_load(url: str, clients: int, requests: int, max_tokens: int, limit_s: float) -> dict:
    deadline = time.perf_counter() + limit_s

    def client(c: int) -> list[dict]:
        rows = []
        for k in range(requests):
            left = deadline - time.perf_counter()
            if left <= 0:
                rows.append({"error": "not sent: the time limit passed"})
                continue
            rows.append(one_request(url, c * requests + k, max_tokens, left))
        return rows

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        rows = [r for batch in pool.map(client, range(clients)) for r in batch]
    wall = time.perf_counter() - began
    ok = [r for r in rows if "error" not in r]
    latencies = [r["latency_s"] for r in ok]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    return {"clients": clients, "requests_per_client": requests, "max_tokens": max_tokens, "time_limit_s": limit_s,
            "requests": len(rows), "completed": len(ok), "errors": len(rows) - len(ok),
            "error_messages": sorted({r["error"] for r in rows if "error" in r})[:5],
            "latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(serve_args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hetero_sd.cli", "serve", "--port", str(port), *shlex.split(serve_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 10 minutes")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an existing server (default: spawn one)")
    ap.add_argument("--serve-args", default="", help="extra `hetero-sd serve` flags for the spawned server")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole load")
    ap.add_argument("--json", default="benchmarks/results/serving/server_load.json")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. what else the machine was running)")
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else spawn(args.serve_args)
    before = machine()
    try:
        result = run_load(url, args.clients, args.requests, args.max_tokens, args.time_limit)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        status = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(120)
    result |= {"server": url if args.url else f"spawned: hetero-sd serve {args.serve_args}".strip(),
               "server_exit_status_after_sigterm": status, "machine": before,
               "loadavg_1m_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "note": args.note,
               "spec_counters": {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                                 if line.startswith("hetero_sd:spec_decode_num_") and "_created" not in line
                                 and "per_pos" not in line}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("requests", "completed", "errors", "latency_p50_s", "latency_p95_s",
                                             "ttft_p50_s", "ttft_p95_s", "tokens_per_s", "wall_s")}, indent=2))


if __name__ == "__main__":
    main()
