"""Device names the runtime understands, and which of them this machine can run."""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import dataclass

import torch

from hetero_sd.errors import DeviceUnavailableError, UnknownDeviceError

# The flags that decide which kernels and dtypes pay (bf16 matmuls are native with avx512_bf16 or AMX).
NOTABLE_FLAGS = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def capability(flags: frozenset[str] | None = None) -> str:
    """torch's CPU dispatch level and the notable flags (default: this CPU's), e.g. 'AVX512; amx_bf16, ...'."""
    extras = sorted((cpu_flags() if flags is None else flags) & NOTABLE_FLAGS)
    return torch.backends.cpu.get_cpu_capability() + (f"; {', '.join(extras)}" if extras else "")


KNOWN = "cpu, cuda, cuda:N, mps, mlx, ane-sim (drafts), ane / coreml-gpu / coreml-cpu (drafts, macOS)"
DRAFT_ONLY = ("ane-sim", "ane", "coreml-gpu", "coreml-cpu")


@dataclass
class DeviceInfo:
    name: str
    backend: str
    available: bool
    detail: str


def devices() -> list[DeviceInfo]:
    """Every device family the runtime has a backend for, with whether this machine has it."""
    infos = [DeviceInfo("cpu", "torch", True, f"torch {torch.__version__}, {torch.get_num_threads()} threads")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            infos.append(DeviceInfo(f"cuda:{i}", "torch", True, torch.cuda.get_device_name(i)))
    else:
        infos.append(DeviceInfo("cuda", "torch", False, "torch.cuda.is_available() is False"))
    mps = torch.backends.mps.is_available()
    infos.append(DeviceInfo("mps", "torch", mps, "Apple GPU via torch" if mps else "not an Apple-silicon Mac"))
    why = mlx_missing()
    infos.append(DeviceInfo("mlx", "mlx", why is None, why or ("Metal GPU" if platform.system() == "Darwin"
                                                                else "MLX on the CPU (mlx[cpu]: slow reference BLAS)")))
    infos.append(DeviceInfo("ane-sim", "emulation", True,
                            "EMULATION: the fp16-safe draft graph with every op rounded to fp16, on the CPU"))
    why = core_ml_missing()
    for name in ("ane", "coreml-gpu", "coreml-cpu"):
        infos.append(DeviceInfo(name, "coreml", why is None, why or "Core ML (the draft compiled by compile-ane)"))
    return infos


def core_ml_missing() -> str | None:
    """Why Core ML devices cannot run here, or None when they can."""
    if platform.system() != "Darwin":
        return "Core ML prediction needs macOS (use ane-sim here)"
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return "coremltools is not installed (pip install 'hetero-sd[coreml]')"
    return None


def mlx_missing() -> str | None:
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        return "mlx is not installed (pip install 'hetero-sd[mlx]'; on Linux: mlx[cpu])"
    return None


def cpu_bound(device: str) -> bool:
    """Devices whose work runs on this machine's CPU cores (they compete for them)."""
    return device in ("cpu", "ane-sim") or (device == "mlx" and platform.system() != "Darwin")


def check_device(name: str, role: str = "draft") -> str:
    """Normalise a device name, or say why it cannot be used here (role: "target" or "draft")."""
    name = name.strip().lower()
    if name == "cpu":
        return name
    if name in DRAFT_ONLY and role == "target":
        raise UnknownDeviceError(f"{name!r} runs drafts only, not the target",
                                 "use it as --draft-device; put the target on cpu, cuda or mps")
    if name == "ane-sim":
        return name
    if name == "mlx":
        why = mlx_missing()
        if why:
            raise DeviceUnavailableError(f"device 'mlx' is not available: {why}", "install it, or use cpu")
        return name
    if name in ("ane", "coreml-gpu", "coreml-cpu"):
        why = core_ml_missing()
        if why is None:
            return name
        raise DeviceUnavailableError(f"device {name!r} is not available: {why}",
                                     "use --draft-device ane-sim: the same fp16 draft graph, emulated on the CPU")
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {name!r} is not present on this machine (no CUDA GPU)",
                                         "use --target-device/--draft-device cpu; `hetero-sd devices` lists what is here")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)",
                                         "pick an index below that")
        return f"cuda:{index}"
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceUnavailableError("device 'mps' is not present on this machine (not an Apple-silicon Mac)",
                                         "use cpu; `hetero-sd devices` lists what is here")
        return name
    raise UnknownDeviceError(f"unknown device {name!r}", f"use one of: {KNOWN}")
