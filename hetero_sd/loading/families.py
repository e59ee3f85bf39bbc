"""Which path runs a target: our fast torch/MLX layers for the families they implement (llama, qwen2,
qwen3 with full attention), transformers' own model class for every other family it knows (hybrid,
MoE, sliding-window: backends/hf_backend). The runtime names the path in its info and notes."""

from __future__ import annotations

from pathlib import Path

from hetero_sd.backends.base import TargetBackend
from hetero_sd.backends.placement import INT8, resolve_dtype, target_backend
from hetero_sd.backends.policy import DEFAULT, LoadPolicy
from hetero_sd.errors import ConfigError
from hetero_sd.models.config import ArchConfig, read_json
from hetero_sd.models.hf_config import fast_path, hf_arch

FAST = "fast"  # our own layers (backends/torch_backend, backends/mlx_backend)
TRANSFORMERS = "transformers"  # transformers' AutoModelForCausalLM (backends/hf_backend); on mlx: mlx-lm


def target_config(folder: Path) -> tuple[ArchConfig, str]:
    """The target's shape and the path that will run it."""
    where = folder / "config.json"
    raw = read_json(where)
    if fast_path(raw) and not raw.get("quantization"):  # mlx-lm's quantized folders: mlx-lm reads them
        return ArchConfig.from_dict(raw, str(where)), FAST
    return hf_arch(raw, str(where)), TRANSFORMERS


def load_target(folder: Path, cfg: ArchConfig, path: str, device: str, dtype, layer_ids, max_context,
                notes: list[str], policy: LoadPolicy = DEFAULT) -> TargetBackend:
    if path == FAST:
        return target_backend(folder, cfg, device, dtype, layer_ids, max_context, notes, policy)
    if device == "mlx":
        from hetero_sd.backends import hf_backend

        return hf_backend.load_mlx_target(folder, cfg, layer_ids, max_context, notes)
    if device in ("ane-sim", "ane", "coreml-gpu", "coreml-cpu"):
        raise ConfigError(f"target {cfg.model_type} runs through transformers (torch) or mlx-lm, not on {device}",
                          "use --target-device cpu, cuda, mps or mlx for this target")
    if dtype == INT8:
        raise ConfigError(f"--dtype {INT8} is a fast-path CPU target (llama/qwen2/qwen3 GGUF blocks); "
                          f"{cfg.model_type} runs through transformers", "use float32, bfloat16 or float16")
    from hetero_sd.backends import hf_backend

    return hf_backend.load_target(folder, cfg, device, resolve_dtype(dtype, device), layer_ids, max_context, notes)


def paths() -> list[tuple[str, str, str, str]]:
    """(path, families, devices, version) for `hetero-sd devices`."""
    from importlib import metadata

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return [(FAST, "llama, qwen2, qwen3 (full attention)", "cpu, cuda, mps, mlx", "this package"),
            (TRANSFORMERS, "any causal LM transformers loads (hybrid, MoE, sliding window, ...)", "cpu, cuda, mps",
             f"transformers {version('transformers')}"),
            ("mlx-lm", "any family mlx-lm has, its 4/8-bit models", "mlx", f"mlx-lm {version('mlx-lm')}")]
