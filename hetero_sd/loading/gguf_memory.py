"""A GGUF target of any type gguf-py reads (Q4_K_M, Q5_K_M, Q6_K, IQ*, ...). Tensors that a kernel here
multiplies as they are (Q4_1 / Q8_0 on the fast CPU float32 path: backends/torch_backend/quant.py) stay
quantized; every other tensor is dequantized (transformers' GGUF loader calls gguf.quants.dequantize)
into the target's dtype. That is announced with the memory it takes, and refused, naming the memory it
would need, when it does not fit the device -- before the conversion, not after an out-of-memory kill."""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.errors import ConfigError

FAST_ARCHS = ("llama", "qwen2", "qwen3")  # GGUF architectures our fast layers run (Q4_1/Q8_0 kernels)
KERNELS = {"Q4_1", "Q8_0"}
PLAIN = {"F32", "F16", "BF16"}  # not quantized: nothing to announce
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class GGUFSummary:
    arch: str
    types: Counter  # tensor type name -> number of tensors
    elements: dict  # tensor type name -> number of weights
    stored: dict  # tensor type name -> bytes in the file


def summarize(path: Path) -> GGUFSummary:
    """Tensor types, weights and bytes from the GGUF header. A walk that skips the metadata values
    (gguf.GGUFReader decodes every tokenizer string: ~10 s for a 49k vocabulary on this CPU); the
    sizes per type are gguf-py's (GGML_QUANT_SIZES)."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", m, 0)
        if magic != b"GGUF" or version < 2:
            raise ConfigError(f"{path} is not a GGUF v2+ file", "give a real .gguf model file")
        pos, arch = 24, "unknown"

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8:at + 8 + n].decode("utf-8", "replace"), at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind in scalar:
                return at + scalar[kind]
            if kind == 8:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind == 9:
                inner, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if inner in scalar:
                    return at + scalar[inner] * count
                for _ in range(count):
                    at = skip(inner, at)
                return at
            raise ConfigError(f"{path}: unknown GGUF metadata type {kind}", "re-download the file")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            if key == "general.architecture" and kind == 8:
                arch = string(pos + 4)[0]
            pos = skip(kind, pos + 4)
        types, elements, stored = Counter(), Counter(), Counter()
        for _ in range(n_tensors):
            _, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            (kind,) = struct.unpack_from("<I", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 4 + 8
            qtype = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[qtype]
            count = 1
            for d in dims:
                count *= d
            types[qtype.name] += 1
            elements[qtype.name] += count
            stored[qtype.name] += count // block * size
    return GGUFSummary(arch, types, dict(elements), dict(stored))


def available_bytes(device: str) -> int:
    """Free memory where the weights will live: the GPU's for CUDA, else the machine's RAM (MPS shares it)."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        return int(torch.cuda.mem_get_info(index)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def plan(summary: GGUFSummary, device: str, dtype: str) -> tuple[int, list[str]]:
    """(bytes the weights take once loaded, the quantized types that get dequantized)."""
    kept = KERNELS if summary.arch in FAST_ARCHS and device == "cpu" and dtype in ("float32", "int8") else set()
    width = BYTES.get(dtype, 4)
    need = sum(summary.stored[k] if k in kept else summary.elements[k] * width for k in summary.types)
    dequantized = sorted(k for k in summary.types if k not in kept and k not in PLAIN)
    return need, dequantized


def check_gguf(path: Path, device: str, dtype: str, notes: list[str], free: int | None = None) -> None:
    """Announce the dequantized types and their memory; refuse when it exceeds what `device` has free."""
    summary = summarize(path)
    need, dequantized = plan(summary, device, dtype)
    free = available_bytes(device) if free is None else free
    file_gb, need_gb, free_gb = path.stat().st_size / 1e9, need / 1e9, free / 1e9
    if need > free:
        raise ConfigError(f"{path.name} needs about {need_gb:.1f} GB as {dtype} weights on {device} "
                          f"({', '.join(dequantized) or 'its tensors'} dequantized; the file is {file_gb:.1f} GB), "
                          f"but {device} has {free_gb:.1f} GB free",
                          "use a smaller model or quantization, --dtype bfloat16 (half of float32), a Q4_1/Q8_0 "
                          "GGUF of a llama/qwen2/qwen3 model on the CPU (kept quantized), or a larger machine")
    if dequantized:
        counts = ", ".join(f"{summary.types[k]} {k}" for k in dequantized)
        notes.append(f"GGUF {path.name}: {counts} tensors have no kernel here and are dequantized to {dtype} "
                     f"(about {need_gb:.2f} GB in memory; the file holds {file_gb:.2f} GB)")


def dtype_label(dtype, device: str) -> str:
    if dtype is None:
        return "float32" if device == "cpu" else "bfloat16"
    return str(dtype).removeprefix("torch.")


def gguf_notes(target: str, device: str, dtype, converted: bool) -> list[str]:
    """The checks above for a .gguf target spec (others: nothing). A conversion not yet made also needs
    the float32 weights in RAM once (transformers dequantizes to float32; the folder keeps them exact)."""
    from .default_model import check_gguf as check_magic

    notes: list[str] = []
    path = Path(target).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return notes
    check_magic(path)  # not a GGUF at all (an error page, a truncated copy): named as such
    try:
        check_gguf(path, device, dtype_label(dtype, device), notes)
    except (ValueError, IndexError, OverflowError, UnicodeDecodeError, struct.error) as e:
        raise ConfigError(f"{path} has a damaged GGUF header ({type(e).__name__}: {e})",
                          "re-download the file") from None
    if not converted and device != "cpu":
        check_gguf(path, "cpu", "float32", [])
    return notes
