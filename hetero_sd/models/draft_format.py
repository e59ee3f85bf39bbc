"""Which draft format a checkpoint is, read exactly as z-lab's reference reads it, and strictly.

Two formats run: DFlash (`DFlashDraftModel`) and DFlash2 (`DFlash2DraftModel`: a grouped dynamic causal
convolution around attention and MLP in every layer, and a candidate selector that picks each drafted
token among the top-k of its position given the token chosen before it). Either may have per-layer
sliding-window or causal attention and the scale/multiplier/softcap keys.

Strictness is the point: an architecture, a config key or a tensor this runtime does not apply is an
error naming it. Running a checkpoint while ignoring part of it gives proposals its authors never
measured (lower acceptance, no warning)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from hetero_sd.errors import ConfigError, WeightsError

from . import draft_vocab
from .weights import load_weights

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
    # worse (ours trained at 8: 36% instead of 49% right on chat at b = 2, held out).
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


# --- the folder: z-lab's two files, and ours beside them ------------------------------------------------
#
# config.json and model.safetensors hold exactly what z-lab's checkpoints hold, so every DFlash loader takes
# the folder as it is: z-lab's DFlashDraftModel (from_pretrained reports no unexpected key), vLLM (its
# AutoWeightsLoader raises on an unknown tensor; a top-level draft_vocab_size would make it build an EAGLE-3
# style reduced head), MLX ports (mlx's strict load_weights over every *.safetensors), llama.cpp's converter
# (it cannot map an unknown tensor). What only this runtime applies (the reduced head's ids, the short-block
# flag) is in EXTENSION, a JSON file none of them opens; the lookup table (lookup_corpus.*) and the training
# card (training.json, held_out.json, draft_vocab.json) are other files beside them, read by name.
# Older drafts keep those settings in config.json's dflash_config and the ids as a `draft_vocab` tensor in
# model.safetensors: read_config / read_tensors give both layouts the same in-memory form (the older one).

EXTENSION = "hetero_sd.json"
EXTENSION_FORMAT = "hetero-sd draft extension 1"
OURS = (draft_vocab.KEY, SHORT_BLOCKS)  # config keys z-lab's checkpoints do not have
FIX_EXTENSION = f"re-write the draft with `hetero-sd export-draft DIR --to hetero-sd --out NEW` (or delete {EXTENSION} " \
                "to run it as a plain DFlash draft)"


def read_json_file(path, what: str = "config.json") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no {what} in {path.parent}",
                          "point at a DFlash draft folder (config.json + model.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})", "re-download or re-create the draft folder") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object", "re-create the draft folder")
    return raw


def read_extension(folder) -> dict | None:
    """The folder's EXTENSION as {"short_blocks": bool, "draft_vocab": [ids] | None}, checked; None if absent."""
    path = Path(folder) / EXTENSION
    if not path.is_file():
        return None
    raw = read_json_file(path, EXTENSION)
    if raw.get("format") != EXTENSION_FORMAT:
        raise ConfigError(f"{path}: format {raw.get('format')!r} is not {EXTENSION_FORMAT!r}", FIX_EXTENSION)
    unknown = sorted(set(raw) - {"format", SHORT_BLOCKS, draft_vocab.TENSOR})
    if unknown:
        raise ConfigError(f"{path}: key(s) {', '.join(unknown)} not understood", FIX_EXTENSION)
    ids = raw.get(draft_vocab.TENSOR)
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ConfigError(f"{path}: {draft_vocab.TENSOR} is not a non-empty list of token ids", FIX_EXTENSION)
    short = raw.get(SHORT_BLOCKS, False)
    if not isinstance(short, bool):
        raise ConfigError(f"{path}: {SHORT_BLOCKS} is {short!r}, not true or false", FIX_EXTENSION)
    return {SHORT_BLOCKS: short, draft_vocab.TENSOR: ids}


def read_config(folder) -> dict:
    """The draft's config as this runtime reads it: config.json, with EXTENSION's settings put into its
    dflash_config (a setting given in both files is refused: which one would run is not obvious)."""
    raw = read_json_file(Path(folder) / "config.json")
    ext = read_extension(folder)
    if ext is None:
        return raw
    inside = raw.get("dflash_config") or {}
    twice = [k for k in OURS if k in inside or k in raw]
    if twice:
        raise ConfigError(f"{folder}: {', '.join(twice)} given both in config.json and in {EXTENSION}",
                          f"remove {', '.join(twice)} from config.json ({EXTENSION} holds it)")
    ours = {SHORT_BLOCKS: True} if ext[SHORT_BLOCKS] else {}
    if ext[draft_vocab.TENSOR] is not None:
        ours[draft_vocab.KEY] = len(ext[draft_vocab.TENSOR])
    return raw | {"dflash_config": dict(inside) | ours}


def read_tensors(folder, cfg) -> dict:
    """The draft's tensors under the backends' names (check_tensors), the reduced head's ids among them
    whichever layout holds them. cfg: a config.DraftConfig read by read_config."""
    tensors = load_weights(folder)
    ext = read_extension(folder)
    if ext is not None and ext[draft_vocab.TENSOR] is not None:
        if draft_vocab.TENSOR in tensors:
            raise WeightsError(f"{folder}: the reduced head's ids are both a {draft_vocab.TENSOR} tensor in "
                               f"model.safetensors and a list in {EXTENSION}", FIX_EXTENSION)
        tensors[draft_vocab.TENSOR] = torch.tensor(ext[draft_vocab.TENSOR], dtype=torch.int64)
    return check_tensors(tensors, cfg, folder)


def split_layout(raw: dict, tensors: dict) -> tuple[dict, dict, dict | None]:
    """(config.json, model.safetensors, EXTENSION) of a draft held in the in-memory form: z-lab's keys and
    tensors, and ours apart (None when the draft has nothing of ours)."""
    inside = dict(raw.get("dflash_config") or {})
    short = bool(inside.pop(SHORT_BLOCKS, raw.get(SHORT_BLOCKS, False)))
    size = inside.pop(draft_vocab.KEY, raw.get(draft_vocab.KEY))
    theirs = {k: inside if k == "dflash_config" else v for k, v in raw.items() if k not in OURS}  # order kept
    ids = tensors.get(draft_vocab.TENSOR)
    if (ids is None) != (size is None) or (ids is not None and ids.numel() != size):
        raise WeightsError(f"the draft declares {draft_vocab.KEY} {size} but holds "
                           f"{'no' if ids is None else ids.numel()} ids", draft_vocab.FIX_MAKE)
    weights = {k: v for k, v in tensors.items() if k != draft_vocab.TENSOR}
    ext = None
    if short or ids is not None:
        ext = {"format": EXTENSION_FORMAT, SHORT_BLOCKS: short}
        if ids is not None:
            ext[draft_vocab.TENSOR] = [int(i) for i in ids.tolist()]
    return theirs, weights, ext


def write_folder(folder, raw: dict, tensors: dict, dtype=None) -> None:
    """Write a draft in z-lab's layout plus EXTENSION (removed if the draft has nothing of ours).
    dtype: the floating tensors' dtype in the file (None: as given)."""
    folder = Path(folder)
    config, weights, ext = split_layout(raw, tensors)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, v in weights.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if ext is None:
        (folder / EXTENSION).unlink(missing_ok=True)
    else:
        (folder / EXTENSION).write_text(json.dumps(ext) + "\n")
