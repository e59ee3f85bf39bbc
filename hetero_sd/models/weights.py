"""Reading safetensors (single file or sharded) with errors that say which file and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hetero_sd.errors import WeightsError


def weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is unreadable ({e})", "re-download the model")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise WeightsError(f"{folder} lacks weight shards {missing}", "re-download the model")
        return [folder / s for s in shards]
    raise WeightsError(f"no model.safetensors in {folder}",
                       "re-download the model, or convert it to safetensors")


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise WeightsError(f"{path} is corrupt or truncated ({e})",
                               "delete it and re-download or re-convert the model")
    return tensors


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple | None, where: Path) -> torch.Tensor:
    """One tensor by name, checked for presence and shape."""
    if name not in tensors:
        raise WeightsError(f"{where} has no tensor {name!r}",
                           "the checkpoint is incomplete or of another architecture; re-download it")
    t = tensors[name]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise WeightsError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config says {tuple(shape)}",
                           "config.json and the weights disagree; re-download the model")
    return t


CONVERTED_MARKER = ".hetero-sd-complete"  # written last by the GGUF conversion; it names the source file


def converted_from(folder) -> Path | None:
    """The GGUF file a converted folder was made from (its completion marker names it), if still there."""
    try:
        gguf = Path((Path(folder) / CONVERTED_MARKER).read_text().strip())
    except OSError:
        return None
    return gguf if gguf.suffix == ".gguf" and gguf.is_file() else None
