"""What this CPU can do natively, from /proc/cpuinfo's flags and torch's own dispatch level. Kernel and
dtype choices dispatch on these, never on a machine's name: sessions run on AVX2-only EPYCs, AVX-512
EPYCs and Sapphire Rapids Xeons (AMX)."""

from __future__ import annotations

import functools

import torch

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


def native_bf16() -> bool:
    """bf16 matmuls run on bf16 hardware (AMX tiles or AVX512-BF16 dot products), not by conversion."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def capability() -> str:
    """torch's CPU dispatch level and the notable flags, e.g. 'AVX512; amx_bf16, avx512_bf16, ...'."""
    extras = sorted(cpu_flags() & NOTABLE_FLAGS)
    return torch.backends.cpu.get_cpu_capability() + (f"; {', '.join(extras)}" if extras else "")
