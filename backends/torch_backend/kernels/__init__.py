"""The native CPU kernels: C++ source files beside this module (gemm.cpp, quant.cpp, quant8.cpp, fused.cpp with
the layer's ops by file: fused_norm_rope.h, fused_attend.h and attend_q8.h, fused_swiglu.h), each one translation
unit registered as torch custom ops (TORCH_LIBRARY: torch.ops.hetero_sd_<name>.*, seen by torch.profiler
and torch.compile), compiled once at run time by torch.utils.cpp_extension into its cache
(~/.cache/torch_extensions) and loaded from there by every later run. The Python wrappers that choose and
call them are one level up (gemm.py, quant.py, quant8.py, fused.py); this package imports none of them."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


class KernelUnavailable(RuntimeError):
    """A kernel that cannot be used here: the reason (for a failed build, the compiler's whole output)."""

    @property
    def summary(self) -> str:
        """One line for a note: the first compiler error, else the first line."""
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower() and line != lines[0]]
        return (lines[0] + (f" ... {errors[0]}" if errors else "")) if lines else ""


@functools.cache
def built(name: str):
    return build(name)


def ops(name: str, runs_here: bool = True, why_not: str = ""):
    """torch.ops.hetero_sd_<name>; KernelUnavailable(why_not) on a CPU it does not run on (runs_here False);
    a build that failed once fails again at once, with the same message."""
    if not runs_here:
        raise KernelUnavailable(why_not)
    result = built(name)
    if isinstance(result, KernelUnavailable):
        raise result
    return result


def build(name: str, folder: Path = HERE):
    """torch.ops.hetero_sd_<name>, after building and loading <name>.cpp, or a KernelUnavailable with the
    whole compiler message when it does not build (the caller announces it).

    One build folder per Python environment, torch and source: two venvs sharing ~/.cache/torch_extensions
    under one name rebuild it for each other (their include paths differ) and wait on each other's build
    lock, which stalled a generation for minutes when another checkout's tests ran."""
    source = folder / f"{name}.cpp"
    # the headers it includes count too: a changed header is another build of the sources that include it
    key = f"{sys.prefix}|{torch.__version__}|".encode() + b"".join(p.read_bytes() for p in included(source))
    ninja_on_path()
    try:
        from torch.utils.cpp_extension import load
        load(f"hetero_sd_{name}_{hashlib.sha1(key).hexdigest()[:10]}", sources=[str(source)],
             extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # a compiler or header problem: the whole message travels with the error
        error = KernelUnavailable(f"{name}.cpp did not build: {type(e).__name__}: {str(e).strip()}")
        error.__cause__ = e
        return error
    return getattr(torch.ops, f"hetero_sd_{name}")


def included(source: Path) -> list[Path]:
    """The source and every header beside it that it includes (#include "x.h"), recursively, in include order."""
    seen: list[Path] = []

    def visit(path: Path) -> None:
        if path in seen:
            return
        seen.append(path)
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
            visit(path.parent / name)
    visit(source)
    return seen


def ninja_on_path() -> None:
    """torch builds extensions with the `ninja` binary found on PATH. The `ninja` package installs it
    beside this interpreter, which is not on PATH when a venv is used without being activated."""
    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
