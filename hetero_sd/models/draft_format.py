"""Which draft format a checkpoint is, read exactly as z-lab's reference reads it, and strictly.

Two formats run: DFlash (`DFlashDraftModel`) and DFlash2 (`DFlash2DraftModel`: a grouped dynamic causal
convolution around attention and MLP in every layer, and a candidate selector that picks each drafted
token among the top-k of its position given the token chosen before it). Either may have per-layer
sliding-window or causal attention and the scale/multiplier/softcap keys.

Strictness is the point: an architecture, a config key or a tensor this runtime does not apply is an
error naming it. Running a checkpoint while ignoring part of it gives proposals its authors never
measured (lower acceptance, no warning)."""

from __future__ import annotations

from dataclasses import dataclass

from hetero_sd.errors import ConfigError, WeightsError

from . import draft_vocab

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
FIX_FORMAT = "hetero-sd runs DFlash (DFlashDraftModel) and DFlash2 (DFlash2DraftModel) drafts in z-lab's format"

# Keys the reference looks up in dflash_config first, then at the top level.
SHORT_BLOCKS = "short_blocks"  # ours: the draft was trained on blocks shorter than block_size too (below)
DFLASH_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "output_multiplier",
               "final_logit_softcapping", draft_vocab.KEY, SHORT_BLOCKS}
DFLASH2_KEYS = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}
# Top-level keys that shape the draft's layers (read by config.ArchConfig or below).
SHAPE_KEYS = {"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
              "rope_parameters", "attention_bias", "hidden_act", "layer_types", "sliding_window",
              "use_sliding_window", "max_window_layers", "is_causal", "num_target_layers", "dflash_config"}
# Keys with no effect on a draft's forward pass: bookkeeping, training-only settings, and the embedding
# and position limits of a model whose embedding and head are the target's.
INERT_KEYS = {"architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "use_cache",
              "initializer_range", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
              "tie_word_embeddings", "max_position_embeddings", "_name_or_path", "name_or_path",
              "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class", "id2label",
              "label2id", "problem_type", "torchscript", "use_bfloat16", "chunk_size_feed_forward",
              "is_encoder_decoder", "pruned_heads", "tf_legacy_loss"}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "short_factor", "long_factor", "truncate"}
QWEN3_MAX_WINDOW_LAYERS = 28  # Qwen3Config's default, used to derive layer_types when they are absent
QWEN3_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class LayerAttention:
    """How one draft layer's block queries see keys. The default (non-causal, no window) is DFlash's."""

    causal: bool = False
    window: int | None = None  # a key is visible when its position is within `window` of the query's

    @property
    def plain(self) -> bool:
        return not self.causal and self.window is None


@dataclass(frozen=True)
class DraftFormat:
    name: str  # "dflash" or "dflash2"
    attention: tuple[LayerAttention, ...]
    input_embedding_scale: float = 1.0  # the block's embeddings are multiplied by it
    output_multiplier: float = 1.0  # draft logits are multiplied by it...
    logit_softcap: float | None = None  # ...then squashed to softcap * tanh(logits / softcap)
    conv_kernel_size: int = 0  # DFlash2 only
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    draft_vocab_size: int | None = None  # K: the head scores only the draft's K target ids (draft_vocab.py)
    # True: trained on shorter blocks too (train-draft --short-blocks), so a block of b < block_size runs b rows.
    # False (z-lab's drafts, trained at block_size only): a block of b runs all block_size rows and keeps the
    # first b-1 predictions, as the reference drafts: with fewer mask rows such a draft reads position 1 much
    # worse (ours trained at 8: 36% instead of 49% right on chat at b = 2; benchmarks/confidence_gate.py).
    short_blocks: bool = False

    def block_rows(self, size: int, block_size: int) -> int:
        """How many rows a drafted block of `size` runs (the first `size` of them are used)."""
        return size if self.short_blocks else block_size

    @property
    def extras(self) -> list[str]:
        """What sets this draft apart from a plain DFlash draft, in words."""
        out = ["DFlash2 (dynamic convolution + candidate selector)"] if self.name == "dflash2" else []
        windows = sorted({a.window for a in self.attention if a.window is not None})
        if windows:
            out.append(f"sliding-window attention (window {', '.join(map(str, windows))})")
        if any(a.causal for a in self.attention):
            out.append("causal attention in the block")
        if self.input_embedding_scale != 1.0:
            out.append(f"input_embedding_scale {self.input_embedding_scale:g}")
        if self.output_multiplier != 1.0:
            out.append(f"output_multiplier {self.output_multiplier:g}")
        if self.logit_softcap is not None:
            out.append(f"final_logit_softcapping {self.logit_softcap:g}")
        return out

    @property
    def notes(self) -> list[str]:
        """What the draft declares beyond z-lab's format that every backend applies (describe() lists them)."""
        return ([f"draft head {self.draft_vocab_size} rows"] if self.draft_vocab_size else []) + (
            ["trained for short blocks"] if self.short_blocks else [])

    def describe(self) -> str:
        """The format as named in stats and bench JSON, e.g. 'dflash2 (top-8 selector, kernel 4); sliding...'."""
        base = self.name if self.name == "dflash" else (
            f"dflash2 (top-{self.selector_top_k} selector, conv kernel {self.conv_kernel_size})")
        rest = [e for e in self.extras if not e.startswith("DFlash2")]
        return "; ".join([base] + rest + self.notes)

    def require_plain(self, backend: str) -> None:
        """Backends that implement only plain DFlash refuse everything else, by name."""
        if self.extras:
            raise ConfigError(f"{backend} does not run drafts with {', '.join(self.extras)} yet",
                              "run this draft on the torch backend (--draft-device cpu, cuda or mps)")


def lookup(raw: dict, name: str, default=None):
    """The reference's rule: dflash_config first, then the top level."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def read_format(raw: dict, where: str) -> DraftFormat:
    name = architecture(raw, where)
    check_keys(raw, name, where)
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported in a draft",
                          "use a draft whose MLP activation is silu (as z-lab's are)")
    softcap = lookup(raw, "final_logit_softcapping")
    extra = {}
    if name == "dflash2":
        missing = sorted(k for k in DFLASH2_KEYS if lookup(raw, k) is None)
        if missing:
            raise ConfigError(f"{where}: a DFlash2 draft config needs {', '.join(missing)}",
                              "re-download the draft; its dflash_config is incomplete")
        extra = {k: int(lookup(raw, k)) for k in DFLASH2_KEYS}
        if raw["hidden_size"] % extra["conv_group_size"]:
            raise ConfigError(f"{where}: conv_group_size {extra['conv_group_size']} does not divide hidden_size "
                              f"{raw['hidden_size']}", "re-download the draft")
    return DraftFormat(name=name, attention=layer_attention(raw, where),
                       input_embedding_scale=float(lookup(raw, "input_embedding_scale", 1.0)),
                       output_multiplier=float(lookup(raw, "output_multiplier", 1.0)),
                       logit_softcap=float(softcap) if softcap is not None and float(softcap) > 0 else None,
                       draft_vocab_size=draft_vocab.declared_size(raw, where, raw.get("vocab_size")),
                       short_blocks=short_blocks(raw, where), **extra)


def short_blocks(raw: dict, where: str) -> bool:
    value = lookup(raw, SHORT_BLOCKS, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: dflash_config.{SHORT_BLOCKS} is {value!r}, not true or false",
                          "fix the draft's config.json (train-draft writes it as a JSON boolean)")
    return value


def architecture(raw: dict, where: str) -> str:
    archs = raw.get("architectures")
    if "dflash_config" not in raw and not set(archs or []) & set(ARCHITECTURES):  # e.g. a target model
        named = f"architecture {', '.join(archs)}" if archs else "no DFlashDraftModel architecture"
        raise ConfigError(f"{where} is not a DFlash draft config ({named})",
                          "pass a z-lab DFlash draft folder as --draft, or leave --draft out")
    if archs is None:  # older drafts name none; dflash_config marks them as DFlash
        return "dflash"
    unknown = [a for a in archs if a not in ARCHITECTURES]
    if unknown or len(archs) != 1:
        named = unknown or archs
        raise ConfigError(f"{where}: draft architecture {', '.join(map(str, named))} is not one hetero-sd runs",
                          FIX_FORMAT)
    return ARCHITECTURES[archs[0]]


def check_keys(raw: dict, name: str, where: str) -> None:
    allowed_top = SHAPE_KEYS | INERT_KEYS | DFLASH_KEYS | (DFLASH2_KEYS if name == "dflash2" else set())
    allowed_dflash = DFLASH_KEYS | (DFLASH2_KEYS if name == "dflash2" else set())
    unknown = sorted(set(raw) - allowed_top) + sorted(
        f"dflash_config.{k}" for k in set(raw.get("dflash_config") or {}) - allowed_dflash)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    unknown += sorted(f"rope {k}" for k in set(rope) - ROPE_KEYS)
    if unknown:
        hint = " (DFlash2 keys in a DFlashDraftModel config)" if set(unknown) & (
            DFLASH2_KEYS | {f"dflash_config.{k}" for k in DFLASH2_KEYS}) else ""
        raise ConfigError(f"{where}: config key(s) {', '.join(unknown)} not understood{hint}",
                          f"{FIX_FORMAT}; a key this runtime would ignore changes the draft's output")


def layer_attention(raw: dict, where: str) -> tuple[LayerAttention, ...]:
    """Per layer, as Qwen3Config and the reference derive it: sliding layers are causal unless the config
    says `is_causal`; their window exists only when `use_sliding_window` is set."""
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window", QWEN3_SLIDING_WINDOW) if raw.get("use_sliding_window") else None
    types = raw.get("layer_types") or [
        "sliding_attention" if window is not None and i >= raw.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
        else "full_attention" for i in range(n)]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad or len(types) != n:
        raise ConfigError(f"{where}: layer_types {bad or types} not understood (need {n} of full_attention / "
                          "sliding_attention)", FIX_FORMAT)
    forced = raw.get("is_causal")
    return tuple(LayerAttention(causal=(t == "sliding_attention") if forced is None else bool(forced),
                                window=window if t == "sliding_attention" else None) for t in types)


# --- tensors -------------------------------------------------------------------------------------------

LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
         "input_layernorm.weight", "post_attention_layernorm.weight"]
QK_NORM = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
BIASES = ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
CONV = ["attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
        "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight"]
SELECTOR = ["candidate_selector.predecessor_codebook.weight", "candidate_selector.successor_codebook.weight",
            "candidate_selector.hidden_projection.weight"]
# Published DFlash2 checkpoints name the two codebooks without `.weight`.
RENAMED = {name.removesuffix(".weight"): name for name in SELECTOR[:2]}


def expected_tensors(fmt: DraftFormat, num_layers: int, qk_norm: bool, bias: bool) -> set[str]:
    per_layer = LAYER + (QK_NORM if qk_norm else []) + (BIASES if bias else []) + (
        CONV if fmt.name == "dflash2" else [])
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    names |= {f"layers.{i}.{p}" for i in range(num_layers) for p in per_layer}
    names |= {draft_vocab.TENSOR} if fmt.draft_vocab_size else set()
    return names | (set(SELECTOR) if fmt.name == "dflash2" else set())


def check_tensors(tensors: dict, cfg, where) -> dict:
    """The checkpoint's tensors under the names the backends use; an unused tensor is an error.
    cfg: a config.DraftConfig."""
    fmt, arch, num_layers = cfg.format, cfg.arch, cfg.arch.num_hidden_layers
    tensors = {RENAMED.get(k, k): v for k, v in tensors.items()}
    # the reduced head's ids first: a draft_vocab without its config key is named as such, not as unknown
    ids = draft_vocab.check_ids(tensors.get(draft_vocab.TENSOR), fmt.draft_vocab_size, arch.vocab_size, where)
    unknown = sorted(set(tensors) - expected_tensors(fmt, num_layers, arch.qk_norm, arch.attention_bias))
    if unknown:
        shown = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        raise WeightsError(f"{where}: tensor(s) {shown} not used by a {fmt.name} draft of {num_layers} layers",
                           f"the checkpoint is of another architecture or newer format; {FIX_FORMAT}")
    return tensors if ids is None else tensors | {draft_vocab.TENSOR: ids}
