"""Targets run by transformers' own model classes (torch: cpu, cuda, mps): the families our fast torch
path does not implement (hybrid linear attention, MoE, sliding-window, ...). The draft stays on the
torch draft backend; it reads this target's embedding, head and context features."""

from __future__ import annotations

from pathlib import Path

import torch

from hetero_sd.errors import ConfigError
from hetero_sd.models.config import ArchConfig

from .target import HFTarget

__all__ = ["HFTarget", "load_target"]


def load_target(folder: Path, cfg: ArchConfig, device: str, dtype: torch.dtype, layer_ids=(),
                max_context: int | None = None, notes: list[str] | None = None) -> HFTarget:
    from transformers import AutoModelForCausalLM

    try:
        model, report = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, KeyError, ImportError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"transformers cannot load the target in {folder} ({type(e).__name__}: {first})",
                          "check that the installed transformers knows this model_type "
                          "(pip install -U transformers)") from None
    missing = sorted(report.get("missing_keys") or [])
    if missing:  # transformers would initialise them randomly: another model than the one on disk
        raise ConfigError(f"{folder / 'config.json'}: model_type {cfg.model_type!r} is not supported with these "
                          f"weights: {type(model).__name__} finds no {', '.join(missing[:3])}"
                          f"{' ...' if len(missing) > 3 else ''} ({len(missing)} tensors missing)",
                          "check that config.json belongs to the weights in that folder")
    model = model.to(device).eval()
    notes = notes if notes is not None else []
    notes.append(f"target {cfg.model_type} runs through transformers' {type(model).__name__} (the fast torch "
                 "path covers llama/qwen2/qwen3 with full attention only)")
    max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return HFTarget(model, cfg, device, dtype, layer_ids, max_context, notes)


def load_mlx_target(folder: Path, cfg: ArchConfig, layer_ids=(), max_context: int | None = None,
                    notes: list[str] | None = None):
    """mlx-lm's model class for this folder (any family mlx-lm has, its 4/8-bit quantized models too)."""
    try:
        from mlx_lm.utils import load_model
    except ImportError:
        raise ConfigError(f"target {cfg.model_type} on the mlx device runs through mlx-lm, which is not installed",
                          "pip install mlx-lm (or use --target-device cpu/cuda/mps: transformers)") from None
    from .mlxlm_target import MLXLMTarget

    try:
        model, _ = load_model(Path(folder), model_config=legacy_keys(cfg.raw))
    except (ValueError, KeyError, FileNotFoundError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"mlx-lm cannot load the target in {folder} ({type(e).__name__}: {first})",
                          "use --target-device cpu/cuda/mps (transformers), or a model mlx-lm knows") from None
    notes = notes if notes is not None else []
    quant = cfg.raw.get("quantization") or {}
    notes.append(f"target {cfg.model_type} runs through mlx-lm's {type(model).__name__}"
                 + (f" ({quant.get('bits')}-bit, group {quant.get('group_size')}, as mlx-lm quantized it)" if quant else ""))
    max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return MLXLMTarget(model, cfg, layer_ids, max_context, notes)


def legacy_keys(raw: dict) -> dict:
    """A config written by transformers 5 renames keys that mlx-lm (and the published checkpoints) still
    use: rope_theta (and partial_rotary_factor) moved into rope_parameters, num_experts became
    num_local_experts."""
    extra = {}
    rope = raw.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in raw and key in rope:
            extra[key] = rope[key]
    if "num_experts" not in raw and "num_local_experts" in raw:
        extra["num_experts"] = raw["num_local_experts"]
    return extra
