"""What the commands share: the error console, SIGTERM handled as Ctrl-C, atomic JSON output, and
loading a runtime from the model flags."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

from rich.console import Console

from hetero_sd.errors import OutputPathError
from hetero_sd.decoding.lookup import WEIGHT as LOOKUP_WEIGHT
from hetero_sd.runtime import load

from .policy import policy_from_env

err = Console(stderr=True, soft_wrap=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, CI runners and `kill` send), handled exactly like Ctrl-C: what finished
    is kept and written, then the exit status is 143 (Ctrl-C: 130)."""


def on_sigterm(signum, frame):
    STATE["terminated"] = True
    raise Terminated()


def interrupted_status(e: BaseException | None = None) -> int:
    return 143 if isinstance(e, Terminated) or STATE["terminated"] else 130


STATE = {"terminated": False}  # set when SIGTERM arrived, for code that caught the interrupt on the way


def block_arg(value: str) -> int | str:
    if value in ("auto", "fixed"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a block size nor 'auto' or 'fixed'") from None


def load_runtime(args, schedules: list[str], target_device: str | None = None, draft_device: str | None = None):
    concurrent = next((s for s in schedules if s != "sequential"), "sequential")
    return load(args.target, None if args.draft == "none" else args.draft,
                target_device=target_device or args.target_device, draft_device=draft_device or args.draft_device, dtype=args.dtype, draft_dtype=args.draft_dtype, block_size=args.block_size,
                verify_gate=getattr(args, "verify_gate", None), lookup=getattr(args, "lookup", LOOKUP_WEIGHT),
                schedule=concurrent, cpu_threads=args.threads, policy=policy_from_env(),
                system_prompt=getattr(args, "system_prompt", None),
                chat_template_kwargs=getattr(args, "chat_template_kwargs", None),
                acceptance=getattr(args, "acceptance", "auto"))


def write_json(path: str, data: dict, quiet: bool = False) -> None:
    """A regular file (or a new one) is replaced atomically: a reader, or a kill mid-write, sees the
    previous complete file or the new one. A symlink is written through (its target is replaced, the
    link stays); a special file (/dev/null, a FIFO, a terminal) is written into, never replaced by a
    regular file. A dangling symlink is refused by name."""
    target = Path(path).expanduser()
    text = json.dumps(data, indent=2, default=str)
    try:
        kind = output_kind(target)
        if kind == "special":
            with open(target, "w") as f:
                f.write(text)
        else:
            atomic_write(Path(os.path.realpath(target)), text)
    except OSError as e:
        raise OutputPathError(f"cannot write {target} ({e.strerror or e})",
                              "give a path in a folder you can write to") from None
    if not quiet:
        err.print(f"[dim]wrote {target if kind == 'special' else Path(os.path.realpath(target))}[/]")


def output_kind(target: Path) -> str:
    """'file' (regular, new, or a symlink to one) or 'special' (a device, FIFO or socket, maybe behind a
    symlink); a dangling symlink raises OutputPathError."""
    try:
        st = target.stat()  # follows symlinks
    except FileNotFoundError:
        if target.is_symlink():
            raise OutputPathError(f"{target} is a symlink to {os.readlink(target)}, which does not exist",
                                  "give the path of a regular file (or remove the link)") from None
        return "file"
    return "file" if stat.S_ISREG(st.st_mode) else "special"


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
