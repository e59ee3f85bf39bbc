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
