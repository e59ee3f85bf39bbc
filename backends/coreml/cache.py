"""The Core ML compile cache: a draft's package is compiled once into the model home, keyed by the
draft's folder and block size."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hetero_sd.ane_compiler.compile import convert
from hetero_sd.home import home, writable_home


def compiled_package(reference, dfolder) -> Path:
    """The draft's Core ML package, compiled on first use."""
    key = hashlib.sha1(str(Path(dfolder or "random").resolve()).encode()).hexdigest()[:12]
    ids = reference.weights().draft_vocab  # a reduced head compiles into another package than the full one
    vocab = "" if ids is None else f"-v{ids.numel()}"
    package = home() / "compiled" / f"draft-{key}-b{reference.block_size}{vocab}.mlpackage"
    if not package.exists():
        writable_home("compiling the draft for Core ML")
        package.parent.mkdir(parents=True, exist_ok=True)
        convert(reference, package)
    return package
