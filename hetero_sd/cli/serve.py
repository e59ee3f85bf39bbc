"""`hetero-sd serve`: the OpenAI-compatible server (hetero_sd/server/) on one loaded runtime."""

from __future__ import annotations

import math
import os
import socket
import time

from hetero_sd import validate
from hetero_sd.errors import InvalidArgumentError
from hetero_sd.server.defaults import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, KEEP_ALIVE_S, MAX_BODY_BYTES

from .common import err, load_runtime


def add_parser(sub, add_model_args, add_sampling_args) -> None:
    """The model, device, schedule and dtype flags are generate's (passed in from main.py); the sampling
    flags set the defaults for fields a request leaves out."""
    s = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server (chat and text completions, "
                       "/v1/messages, tool calls, JSON-schema output, SSE, metrics)")
    add_model_args(s, "default")
    add_sampling_args(s, 256)
    s.add_argument("--schedule", default="sequential", help="sequential or overlap")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: loopback only; 0.0.0.0 exposes the server to the network)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $HETERO_SD_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None, help="the model id in /v1/models (default: the target's name)")
    s.add_argument("--workers", type=int, default=4,
                   help="generations in flight at once (interleaved on the devices; each holds its own caches)")
    s.add_argument("--queue", type=int, default=16, help="requests that may wait for a worker; more get a 429")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt in full (default: a new turn reuses the caches of the conversation so far)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds SIGTERM/Ctrl-C lets requests in flight finish before cancelling them")
    s.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body (default {MAX_BODY_BYTES:,}); a larger one is answered 413 and its "
                        "connection closed without reading the rest")
    s.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help=f"seconds a connection has to send a request's headers, from its opening or its previous "
                        f"response (default {HEADER_TIMEOUT_S:g}); then it is closed (408 if a request had begun)")
    s.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help=f"seconds a request body may pause between bytes (default {BODY_TIMEOUT_S:g}); then 408")
    s.add_argument("--tool-call-format", choices=["auto", "hermes", "llama3_json"], default="auto",
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>, Qwen-family), "
                        "llama3_json (bare {\"name\", \"parameters\"}), or auto: read from the chat template "
                        "(docs/server-agents.md)")
    s.add_argument("--keep-alive-timeout", type=float, default=KEEP_ALIVE_S,
                   help=f"seconds an idle connection is kept open between requests (default {KEEP_ALIVE_S:g})")


def check(args) -> None:
    from hetero_sd.runtime import check_schedule

    if check_schedule(args.schedule) == "pipeline":
        raise InvalidArgumentError("--schedule pipeline is for bench's request pairs",
                                   "use --schedule sequential or overlap (concurrent requests interleave anyway)")
    validate.integer("--port", args.port, 0, "pass a TCP port from 0 to 65535 (0: any free port)")
    if args.port > 65535:
        raise InvalidArgumentError(f"--port {args.port} is not a TCP port", "pass a port from 0 to 65535")
    validate.integer("--workers", args.workers, 1, "pass 1 or more workers")
    validate.integer("--queue", args.queue, 0, "pass 0 or more queued requests")
    if not args.shutdown_timeout >= 0:
        raise InvalidArgumentError(f"--shutdown-timeout {args.shutdown_timeout} is negative", "pass seconds >= 0")
    validate.integer("--max-body-bytes", args.max_body_bytes, 1, f"pass a size in bytes, e.g. {MAX_BODY_BYTES}")
    for flag in ("--header-timeout", "--body-timeout", "--keep-alive-timeout"):
        seconds = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(seconds) and seconds > 0):
            raise InvalidArgumentError(f"{flag} must be a finite number of seconds > 0, got {seconds}",
                                       f"pass e.g. {flag} 30")
    if args.api_key is not None and not args.api_key.strip():  # else the server would run with no key at all
        raise InvalidArgumentError("--api-key is empty", "give the key clients must send, or leave --api-key out "
                                                         "(then $HETERO_SD_API_KEY, else no key)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise InvalidArgumentError("--served-model-name is empty", "give the model id clients send, or leave it out "
                                                                   "(the target's name)")
    host(args.host, args.port)


def host(name: str, port: int) -> None:
    """The address resolves to one this machine can bind, before the model loads."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidArgumentError(f"--host {name!r} is not an address or a host name here ({e})",
                                   "pass an address such as 127.0.0.1 (loopback), ::1 or 0.0.0.0 (every interface)"
                                   ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind(address[:1] + (0,) + address[2:])  # port 0: is the address this machine's, whatever the port
        except OSError as e:
            raise InvalidArgumentError(f"--host {name!r} cannot be bound here ({e.strerror or e})",
                                       "pass an address of this machine: 127.0.0.1, ::1 or 0.0.0.0") from None


def warm_up(rt, workers: int) -> None:
    """Every step shape of the caches of as many target/draft pairs as requests run at once, before the first
    request (which would pay their captures or compilations), where a shape costs something on its first use (Runtime.warms)."""
    if rt.warms():
        err.print(f"[dim]warming the steps of {workers} request slots up (each shape captured or compiled once, before the "
                  "first request)...[/]")
        began = time.perf_counter()
        ran = rt.warm(pairs=workers)
        err.print(f"[dim]{ran} step shapes ready in {time.perf_counter() - began:.1f} s[/]")


def cmd_serve(args) -> int:
    from hetero_sd.server import Settings, model_name, serve

    check(args)
    api_key = args.api_key or os.environ.get("HETERO_SD_API_KEY") or None
    rt = load_runtime(args, [args.schedule])
    for note in rt.notes:
        err.print(f"[yellow]note:[/] {note}")
    settings = Settings(args.served_model_name or model_name(rt), api_key, args.workers, args.queue,
                        args.max_new_tokens, dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                                  seed=args.seed, rule=args.rule),
                        prefix_cache=not args.no_prefix_cache, max_body_bytes=args.max_body_bytes,
                        body_timeout=args.body_timeout, tool_format=args.tool_call_format)
    warm_up(rt, args.workers)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        err.print(f"[yellow]note:[/] listening on {args.host} without --api-key: anyone who reaches it can use it")
    err.print(f"[dim]serving {settings.model_name} on http://{args.host}:{args.port}/v1 "
              f"({'API key required' if api_key else 'no API key'})[/]")
    status = serve(rt, settings, host=args.host, port=args.port, shutdown_s=args.shutdown_timeout,
                   header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout)
    if status:
        err.print("[yellow]terminated[/]: requests in flight finished or were cancelled; the server stopped cleanly")
    return status
