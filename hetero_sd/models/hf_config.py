"""The shape of a target that transformers' own model classes run (hybrid, MoE, sliding-window...): the
fields the draft and the runtime read (width, depth, vocabulary, heads for a random draft), taken from
the text part of its config.json. The fast torch path reads only the families in config.SUPPORTED_TYPES."""

from __future__ import annotations

from hetero_sd.errors import ConfigError

from .config import SUPPORTED_TYPES, ArchConfig


def text_part(raw: dict) -> dict:
    """A multimodal config (qwen3_5, gemma4) nests the decoder's fields under text_config."""
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def fast_path(raw: dict) -> bool:
    """True where our own torch/MLX layers run the target: llama/qwen2/qwen3 with full attention only."""
    layer_types = set(raw.get("layer_types") or ["full_attention"])
    return (raw.get("model_type") in SUPPORTED_TYPES and layer_types == {"full_attention"}
            and not raw.get("use_sliding_window"))


def hf_arch(raw: dict, where: str = "config.json") -> ArchConfig:
    text = text_part(raw)
    try:
        hidden, heads = text["hidden_size"], text["num_attention_heads"]
        rope = text.get("rope_parameters") or {}
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        return ArchConfig(
            model_type=text.get("model_type") or raw.get("model_type") or "unknown",
            hidden_size=hidden,
            intermediate_size=text.get("intermediate_size") or text.get("moe_intermediate_size") or 4 * hidden,
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or hidden // heads,
            vocab_size=text["vocab_size"],
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=None,  # applied by transformers' own model class, not read here
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            attention_bias=bool(text.get("attention_bias", False)),
            qk_norm=False,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            raw=raw,
        )
    except KeyError as e:
        raise ConfigError(f"{where} lacks the field {e.args[0]!r} (read from its text part)",
                          "re-create the model folder with its complete config.json") from None
    except TypeError as e:
        raise ConfigError(f"{where}: a field has the wrong type ({e})", "re-create the model folder") from None
