"""What this CPU can do natively: its flags, read once (hetero_sd/devices.py: /proc/cpuinfo), and passed to
the weight plan (plan.py), which hands each kernel its variant. Kernel and dtype choices dispatch on these,
never on a machine's name (the same code runs on AVX2-only EPYCs, AVX-512 EPYCs and Sapphire Rapids Xeons with AMX)."""

from __future__ import annotations

from hetero_sd.devices import capability as capability_of
from hetero_sd.devices import NOTABLE_FLAGS, cpu_flags  # noqa: F401  (re-exported)


def pick_isa(wide: set[str], narrow: set[str], prefer: str | None = None,
             flags: frozenset[str] | None = None) -> str | None:
    """'avx512' where the CPU (default: this one) has the `wide` flags and `prefer` is not 'avx2', 'avx2'
    where it has the `narrow` ones, else None: which variant of a kernel runs."""
    flags = cpu_flags() if flags is None else flags
    if wide <= flags and prefer != "avx2":
        return "avx512"
    return "avx2" if narrow <= flags else None


def native_bf16() -> bool:
    """bf16 matmuls run on bf16 hardware (AMX tiles or AVX512-BF16 dot products), not by conversion."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def capability() -> str:
    """torch's CPU dispatch level and this CPU's notable flags (hetero_sd/devices.py)."""
    return capability_of(cpu_flags())
