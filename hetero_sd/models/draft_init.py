"""Making DFlash drafts in the z-lab format: config.json with dflash_config + model.safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ArchConfig, fallback_layer_ids
from .draft_format import write_folder


def pick_mask_token(tokenizer) -> int:
    """`<|MASK|>` when the tokenizer has one, else the highest-id special token that is not
    bos/eos/pad/unk or used by the chat template (for SmolLM2: an unused code-metadata token)."""
    vocab = tokenizer.get_vocab()
    if "<|MASK|>" in vocab:
        return vocab["<|MASK|>"]
    template = tokenizer.chat_template or ""
    busy = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token}
    specials = [t for t in tokenizer.all_special_tokens if t not in busy and t not in template]
    specials += [t for t in getattr(tokenizer, "added_tokens_encoder", {}) if t not in busy and t not in template]
    if not specials:
        raise ValueError("the tokenizer has no spare special token to use as the mask token")
    return max(vocab[t] for t in set(specials) if t in vocab)


def draft_config(target: ArchConfig, *, num_layers: int, block_size: int, mask_token_id: int,
                 layer_ids: list[int] | None = None) -> dict:
    """A Qwen3-style draft at the target's width (it shares the target's embedding and lm_head)."""
    layer_ids = layer_ids or random_layer_ids(target.num_hidden_layers)
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids},
        "num_target_layers": target.num_hidden_layers, "num_hidden_layers": num_layers,
        "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * num_layers,
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    }


def random_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """The reference's rule where it gives distinct layers of the target; below 8 layers it repeats
    layers or leaves the target (2 layers: [1, -1]), so evenly spaced distinct layers there."""
    count = min(count, num_layers)
    ids = fallback_layer_ids(num_layers, count)
    if len(set(ids)) == len(ids) and all(0 <= i < num_layers for i in ids):
        return ids
    return sorted({round(i * (num_layers - 1) / max(count - 1, 1)) for i in range(count)})


def random_draft_tensors(config: dict, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Initialised as HF initialises Qwen3 (normal(0, std) matrices, unit norms): an untrained draft."""
    g = torch.Generator().manual_seed(seed)
    h, i, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    nq, nkv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    n_feat = len(config["dflash_config"]["target_layer_ids"])

    def mat(*shape):
        return torch.randn(*shape, generator=g) * std

    t = {"fc.weight": mat(h, n_feat * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
    for n in range(config["num_hidden_layers"]):
        p = f"layers.{n}."
        t.update({p + "self_attn.q_proj.weight": mat(nq, h), p + "self_attn.k_proj.weight": mat(nkv, h),
                  p + "self_attn.v_proj.weight": mat(nkv, h), p + "self_attn.o_proj.weight": mat(h, nq),
                  p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                  p + "mlp.gate_proj.weight": mat(i, h), p + "mlp.up_proj.weight": mat(i, h),
                  p + "mlp.down_proj.weight": mat(h, i),
                  p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)})
    return t


def write_draft(folder: Path, config: dict, tensors: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """z-lab's config.json and model.safetensors, and what only hetero-sd applies beside them
    (draft_format.write_folder)."""
    write_folder(folder, config, tensors, dtype)
    return Path(folder)
