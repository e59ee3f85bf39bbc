"""Which backend runs a model on a device: the torch backend (cpu, cuda, mps), MLX, or the Neural
Engine family (ane-sim, ane, coreml-gpu, coreml-cpu). Reduced-precision draft devices come wrapped with
the float32 reference alongside (ShadowedDraft), which measures their precision drift."""

from __future__ import annotations

from pathlib import Path

import torch

from hetero_sd.errors import ConfigError
from hetero_sd.models.config import ArchConfig, DraftConfig

from . import torch_backend
from .base import DraftBackend, TargetBackend
from .policy import DEFAULT, LoadPolicy
from .shadow import ShadowedDraft

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Not a torch dtype: a float32 CPU target whose decode/verify rows are quantized to int8 into integer dot
# products with its GGUF blocks (llama.cpp's numerics; torch_backend/quant8.py). Another target.
INT8 = "int8"
NEURAL_ENGINE = ("ane-sim", "ane", "coreml-gpu", "coreml-cpu")


def resolve_dtype(dtype, device: str) -> torch.dtype:
    if dtype is None:
        return torch_backend.default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}, or {INT8} for the target")
    return DTYPES[dtype]


def draft_dtype_for(draft_dtype, target_dtype, device: str, stored: torch.dtype | None = None,
                    target_numerics: str | None = None, policy: LoadPolicy = DEFAULT) -> torch.dtype:
    """The asked dtype, else the one the draft is stored in (torch_backend.default_draft_dtype); float32
    beside a target whose int8-row head the draft's own matrices can join (target_numerics 'int8')."""
    if draft_dtype is not None:
        return resolve_dtype(draft_dtype, device)
    int8_rows = target_numerics == INT8 and policy.draft_int8_head and policy.draft_int8_layers
    target_dtype = torch.float32 if target_dtype == INT8 else target_dtype
    return torch_backend.default_draft_dtype(device, resolve_dtype(target_dtype, device), stored, int8_rows)


def stored_dtype(tensors: dict) -> torch.dtype | None:
    """The floating dtype most of a draft's weights are stored in."""
    counts: dict = {}
    for t in tensors.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else None


def dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def target_dtype_note(dtype: torch.dtype, device: str = "cpu") -> str:
    """A reduced-precision target is a different target; say what it costs and what it breaks. On an
    accelerator it is the default (bf16), and its GEMMs, like the CPU's, pick their reduction order by the
    number of rows: a verify of k rows and a one-row decode step can round a near-tie apart."""
    device = torch.device(device).type  # "cuda:0" as the placement names it: the note speaks of the kind
    kernels = "CPU kernels" if device == "cpu" else f"{device} GEMMs"
    note = (f"{dtype_name(dtype)} target: a different model than the float32 one (outside the parity tests' "
            f"1e-4); its {kernels} are not batch-invariant, so DFlash can emit tokens that differ from "
            "autoregressive decoding of this target where two logits nearly tie"
            + ("" if device == "cpu" else " (--dtype float32 for token identity)"))
    if device == "cpu" and dtype == torch.bfloat16 and not torch_backend.native_bf16():
        note += "; this CPU has no native bf16 (AMX or AVX512-BF16): its matmuls are emulated, slower than float32"
    return note


def target_backend(folder: Path, cfg: ArchConfig, device: str, dtype, layer_ids, max_context,
                   notes: list[str] | None = None, policy: LoadPolicy = DEFAULT) -> TargetBackend:
    """The target on its device; notes say what the caller might not expect (a reduced-precision target,
    a kernel that did not build here). The torch backend makes its weight plan from `policy`."""
    if device == "mlx":
        from . import mlx_backend
        return mlx_backend.load_target(folder, cfg, layer_ids, max_context, steps=policy.steps)
    activations = "float32"
    if dtype is None and device == "cpu":  # a GGUF target: int8 rows x its blocks, llama.cpp's numerics
        dtype, why_not = torch_backend.default_target_numerics(folder, device, policy)
        dtype = None if dtype == "float32" else dtype
        if why_not and notes is not None:
            notes.append(why_not)
    if dtype == INT8:
        if device != "cpu":
            raise ConfigError(f"--dtype {INT8} is a CPU target (integer dot products with GGUF blocks), not {device}",
                              "use --target-device cpu, or another --dtype")
        activations, dtype = INT8, torch.float32
    dtype = resolve_dtype(dtype, device)
    if dtype != torch.float32 and notes is not None:
        notes.append(target_dtype_note(dtype, device))
    target = torch_backend.load_target(folder, cfg, device, dtype, layer_ids, max_context, activations, policy)
    if notes is not None:
        notes += target.notes
    return target


def draft_backend(dfolder: Path | None, dcfg: DraftConfig, target: TargetBackend, device: str, dtype, mask: int,
                  tensors: dict, notes: list[str], policy: LoadPolicy = DEFAULT) -> DraftBackend:
    """The draft on its device, paired with `target` (it shares the target's embedding and head)."""
    if not policy.draft_vocab and "draft_vocab" in tensors:  # every backend then scores the whole head
        tensors = {k: v for k, v in tensors.items() if k != "draft_vocab"}
        notes.append(f"draft head: every row of the target's head (the draft's draft_vocab of "
                     f"{dcfg.format.draft_vocab_size} is {policy.why()})")
    if device == "mlx":
        dcfg.format.require_plain("the MLX backend")
        from . import mlx_backend
        return mlx_backend.load_draft(dfolder, dcfg, target, mask, tensors, steps=policy.steps)
    if device not in NEURAL_ENGINE:
        draft = torch_backend.load_draft(dfolder, dcfg, target, device, resolve_dtype(dtype, device), mask, tensors,
                                         policy=policy)
        notes += draft.notes  # e.g. the head it multiplies, a kernel that did not build
        return draft
    dcfg.format.require_plain(f"the Neural Engine graph (draft device {device})")
    reference = torch_backend.load_draft(dfolder, dcfg, target, "cpu", torch.float32, mask, tensors, int8_head=False,
                                         policy=policy)
    if device == "ane-sim":
        from .coreml import AneSimDraft

        notes.append("draft device ane-sim is an EMULATION of the Neural Engine's fp16 arithmetic on the CPU: "
                     "its numerics emulate the ANE fp16 format, its timings say nothing about the ANE")
        return ShadowedDraft(AneSimDraft(reference), reference)
    from .coreml.cache import compiled_package
    from .coreml.device import CoreMLDraft

    package = compiled_package(reference, dfolder)
    notes.append(f"draft on {device} through Core ML ({package}); drift measured on every 8th block")
    return ShadowedDraft(CoreMLDraft.open(reference, package, device), reference, every=8)
