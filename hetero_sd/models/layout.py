"""Backend-neutral facts of a Llama/Qwen decoder: its tensors' names and shapes per layer, and RoPE's
frequencies. The torch and MLX backends, training and the probes read them from here."""

from __future__ import annotations

import torch

from .config import ArchConfig
from .weights import take


def inv_frequencies(cfg: ArchConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention factor; scaled variants come from transformers."""
    if cfg.rope_scaling is None:
        exps = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        return (1.0 / cfg.rope_theta ** exps).float(), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    hf_config = AutoConfig.for_model(cfg.model_type, **{k: v for k, v in cfg.raw.items()
                                                      if k not in ("model_type", "auto_map")})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(factor)



LAYER_TENSORS = {
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
    "input_layernorm": "input_layernorm.weight", "post_attention_layernorm": "post_attention_layernorm.weight",
}


def layer_shapes(cfg: ArchConfig) -> dict[str, tuple]:
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"q_proj": (nq, h), "k_proj": (nkv, h), "v_proj": (nkv, h), "o_proj": (h, nq),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "input_layernorm": (h,), "post_attention_layernorm": (h,),
            "q_norm": (hd,), "k_norm": (hd,), "q_bias": (nq,), "k_bias": (nkv,), "v_bias": (nkv,)}


def layer_weights(tensors, prefix: str, cfg: ArchConfig, where, device, dtype) -> dict[str, torch.Tensor]:
    """Gather and shape-check one layer's tensors (prefix like 'model.layers.3.')."""
    names = dict(LAYER_TENSORS)
    if cfg.qk_norm:
        names.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    if cfg.attention_bias:
        names.update(q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias",
                     v_bias="self_attn.v_proj.bias")
    shapes = layer_shapes(cfg)
    return {key: take(tensors, prefix + name, shapes[key], where).to(device, dtype)
            for key, name in names.items()}
