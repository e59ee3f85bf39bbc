"""Checks that a draft was made for the target it is paired with: its hidden size, vocabulary, mask token
and the target layers its features come from (a published DFlash checkpoint names them in config.json)."""

from __future__ import annotations

from hetero_sd.models.config import ArchConfig, DraftConfig
from hetero_sd.errors import ConfigError, MismatchError

FIX = "use a DFlash draft trained for this target (or train one: hetero-sd train-draft)"


def feature_layers(draft: DraftConfig, target: ArchConfig, fc_in_features: int) -> list[int]:
    if fc_in_features % target.hidden_size:
        raise MismatchError(f"draft fc takes {fc_in_features} features, not a multiple of the target's "
                            f"hidden size {target.hidden_size}", FIX)
    layer_ids = draft.layer_ids(fc_in_features // target.hidden_size)
    bad = [i for i in layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise MismatchError(f"draft reads target layers {bad}, but the target has only "
                            f"{target.num_hidden_layers} layers (0..{target.num_hidden_layers - 1})", FIX)
    if len(layer_ids) * target.hidden_size != fc_in_features:
        raise MismatchError(f"draft fc takes {fc_in_features} features but {len(layer_ids)} target layers "
                            f"x hidden {target.hidden_size} give {len(layer_ids) * target.hidden_size}", FIX)
    return layer_ids


def check_pair(draft: DraftConfig, target: ArchConfig, mask_token_id: int | None) -> int:
    """Raise a MismatchError naming the first incompatibility; return the mask token id."""
    arch = draft.arch
    if arch.hidden_size != target.hidden_size:
        raise MismatchError(f"draft hidden size {arch.hidden_size} != target hidden size "
                            f"{target.hidden_size} (the draft shares the target's embedding and lm_head)", FIX)
    if arch.vocab_size != target.vocab_size:
        raise MismatchError(f"draft vocab size {arch.vocab_size} != target vocab size {target.vocab_size}", FIX)
    if draft.num_target_layers not in (None, target.num_hidden_layers):
        raise MismatchError(f"draft was trained on a {draft.num_target_layers}-layer target, this target "
                            f"has {target.num_hidden_layers} layers", FIX)
    if mask_token_id is None:
        raise ConfigError("the draft names no mask token and the tokenizer has no <|MASK|> token",
                          "add dflash_config.mask_token_id to the draft's config.json")
    if not 0 <= mask_token_id < target.vocab_size:
        raise MismatchError(f"draft mask token id {mask_token_id} lies outside the target's embedding "
                            f"table (vocab {target.vocab_size})", FIX)
    if draft.block_size < 2:
        raise ConfigError(f"block size {draft.block_size} leaves no room for drafts", "use a block size >= 2")
    return mask_token_id
