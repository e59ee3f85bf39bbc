"""Model configs read straight from HF `config.json` files (targets and z-lab DFlash drafts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .draft_format import DraftFormat, lookup, read_config, read_format
from hetero_sd.errors import ConfigError

# Decoder families whose blocks our backends implement (Llama-style pre-norm blocks, GQA, RoPE).
SUPPORTED_TYPES = {"llama": dict(qk_norm=False), "qwen3": dict(qk_norm=True), "qwen2": dict(qk_norm=False)}


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"no config.json in {path.parent}",
                          "point at a model folder in HF format (config.json + model.safetensors)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})", "re-download or re-create the model folder")


@dataclass
class ArchConfig:
    """The shape of one decoder stack (a target, or the layers of a draft)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ArchConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise ConfigError(f"{where}: model_type {model_type!r} is not supported",
                              f"use a {', '.join(sorted(SUPPORTED_TYPES))} model")
        layer_types = set(raw.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"} or raw.get("use_sliding_window"):
            raise ConfigError(f"{where}: sliding-window attention layers are not supported",
                              "use a model whose layers are all full attention")
        check_values(raw, where)
        try:
            heads = raw["num_attention_heads"]
            rope_params = raw.get("rope_parameters") or {}
            scaling = raw.get("rope_scaling") or rope_params or None
            rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
            eos = raw.get("eos_token_id")
            return cls(
                model_type=model_type,
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                vocab_size=raw["vocab_size"],
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
                rope_scaling=scaling if rope_type != "default" else None,
                max_position_embeddings=raw.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                qk_norm=SUPPORTED_TYPES[model_type]["qk_norm"],
                eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
                raw=raw,
            )
        except KeyError as e:
            raise ConfigError(f"{where} lacks the field {e.args[0]!r}", "re-create the model folder")


SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
POSITIVE_REALS = ("rms_norm_eps", "rope_theta")


def check_values(raw: dict, where: str) -> None:
    """Sizes are ints >= 1 and eps/theta numbers > 0 (a "576" or a null would fail deep in the layers)."""
    def bad(key, want):
        raise ConfigError(f"{where}: {key} is {raw[key]!r}, not {want}", f"fix {key} in {where} (or re-create the folder)")

    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1
    for key in SIZES:
        if key in raw and not whole(raw[key]):
            bad(key, "an integer >= 1")
    for key in OPTIONAL_SIZES:
        if raw.get(key) is not None and not whole(raw[key]):
            bad(key, "an integer >= 1")
    for key in POSITIVE_REALS:
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf")):
            bad(key, "a number > 0")


QWEN3_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32, "rms_norm_eps": 1e-6, "attention_bias": False}


def fallback_layer_ids(num_target_layers: int, num_draft_feature_layers: int) -> list[int]:
    """Target layers used when a draft config names none (the reference implementation's rule)."""
    n, count = num_target_layers, num_draft_feature_layers
    if count == 1:
        return [n // 2]
    return [round(1 + i * (n - 4) / (count - 1)) for i in range(count)]


@dataclass
class DraftConfig:
    """A z-lab DFlash draft: its own layers, plus which target layers feed it and how it fills a block."""

    arch: ArchConfig
    block_size: int
    mask_token_id: int | None
    target_layer_ids: list[int] | None
    num_target_layers: int | None
    format: DraftFormat = None  # DFlash or DFlash2, attention per layer, scales (draft_format.py)

    @classmethod
    def from_folder(cls, folder: Path) -> "DraftConfig":
        # config.json with the settings only this runtime applies (draft_format.EXTENSION) put in dflash_config
        return cls.from_dict(read_config(folder), str(folder / "config.json"))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "draft config") -> "DraftConfig":
        fmt = read_format(raw, where)  # strict: unknown architectures and keys are errors
        # Attention per layer lives in fmt; the layers' shapes are a plain decoder's. The reference builds
        # every draft from Qwen3 layers (q/k norms; bias only if attention_bias) whatever model_type says.
        layers_raw = {k: v for k, v in raw.items() if k not in ("layer_types", "use_sliding_window")}
        layers_raw["model_type"] = "qwen3"
        for key, default in QWEN3_DEFAULTS.items():  # what Qwen3Config fills in when a key is absent
            layers_raw.setdefault(key, default)
        return cls(
            arch=ArchConfig.from_dict(layers_raw, where),
            block_size=int(lookup(raw, "block_size", 16)),
            mask_token_id=lookup(raw, "mask_token_id"),
            target_layer_ids=lookup(raw, "target_layer_ids"),
            num_target_layers=raw.get("num_target_layers"),
            format=fmt,
        )

    def layer_ids(self, num_feature_layers: int) -> list[int]:
        if self.target_layer_ids is not None:
            return list(self.target_layer_ids)
        if self.num_target_layers is None:
            raise ConfigError("draft config names neither target_layer_ids nor num_target_layers",
                              "add dflash_config.target_layer_ids to the draft's config.json")
        return fallback_layer_ids(self.num_target_layers, num_feature_layers)
