"""The loader: from names (a folder, a hub id, a .gguf file, "default", "random") to a target and a
draft backend on their devices, the tokenizer and the stop ids. `hetero_sd.load` wraps it in a Runtime."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from hetero_sd import validate
from hetero_sd.backends.base import DraftBackend, TargetBackend
from hetero_sd.backends.policy import DEFAULT, LoadPolicy
from hetero_sd.backends.placement import draft_backend, draft_dtype_for, dtype_name, stored_dtype
from hetero_sd.devices import check_device, cpu_bound
from hetero_sd.errors import ConfigError, ModelNotFoundError
from hetero_sd.models.config import ArchConfig, DraftConfig, read_json
from hetero_sd.models.draft_format import read_tensors
from hetero_sd.models.draft_init import draft_config, pick_mask_token, random_draft_tensors
from hetero_sd.models.weights import take

from .default_model import DEFAULT_TARGET, is_converted
from .families import load_target, target_config
from .pairing import check_pair, feature_layers
from .gguf_memory import gguf_notes
from .pairs import auto_draft
from .sources import resolve_folder, resolve_target, source_gguf

RANDOM_DRAFT_LAYERS = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
SHIPPED_DRAFTS = {"default": DEFAULT_TARGET, "cpu-trained": f"{DEFAULT_TARGET}-cpu-trained"}


@dataclass
class Loaded:
    target: TargetBackend
    draft: DraftBackend | None
    tokenizer: object
    stop_ids: list[int]
    info: dict  # what was loaded, where, in which dtypes; "notes" say what the caller might not expect
    block: str = "fixed"  # "auto" (the block-size controller) or "fixed"
    target_folder: Path | None = None
    draft_folder: Path | None = None  # None for a random draft


def load_models(target: str = "default", draft: str | None = "default", *, target_device: str = "cpu",
                draft_device: str | None = None, schedule: str = "sequential", dtype=None, draft_dtype=None,
                block_size: int | str | None = None, max_context: int | None = None,
                cpu_threads: int | None = None, policy: LoadPolicy = DEFAULT) -> Loaded:
    """Resolve, check and load; arguments as for `hetero_sd.load` (the schedule is checked there)."""
    target_device = check_device(target_device, "target")
    draft_device = check_device(draft_device or target_device, "draft")
    validate.threads(cpu_threads)
    notes = gguf_target_notes(target, target_device, dtype)  # refused here if it cannot fit, before converting
    folder = resolve_target(target)
    tcfg, path = target_config(folder)  # families.py: our fast layers, or transformers' model class
    tokenizer = load_tokenizer(folder)
    info = {"target": str(folder), "target_device": target_device, "draft": None, "draft_device": None,
            "gguf": source_gguf(target), "notes": notes, "target_path": path}
    draft = default_draft(draft, target, info["notes"])
    if draft is None:
        t = load_target(folder, tcfg, path, target_device, dtype, (), max_context, info["notes"], policy)
        info["target_dtype"] = getattr(t, "numerics", None) or dtype_name(getattr(t, "dtype", None))
        info["target_weights"] = getattr(t, "weight_format", info["target_dtype"])  # e.g. GGUF blocks (quant.py)
        info["weight_plan"] = getattr(t, "weight_plan", info["target_weights"])  # the torch plan (plan.py)
        return Loaded(t, None, tokenizer, stop_ids(tcfg, tokenizer, folder), info, target_folder=folder)

    dcfg, tensors, dfolder = draft_source(draft, tcfg, tokenizer, info["notes"])
    layer_ids = feature_layers(dcfg, tcfg, take(tensors, "fc.weight", None, dfolder or draft).shape[1])
    mask = dcfg.mask_token_id
    if mask is None and "<|MASK|>" in tokenizer.get_vocab():
        mask = tokenizer.convert_tokens_to_ids("<|MASK|>")
    mask = check_pair(dcfg, tcfg, mask)
    block = "auto" if validate.block_size(block_size, dcfg.block_size) in (None, "auto") else "fixed"
    if isinstance(block_size, int):
        dcfg.block_size = int(block_size)
    t = load_target(folder, tcfg, path, target_device, dtype, layer_ids, max_context, info["notes"], policy)
    info["target_dtype"] = getattr(t, "numerics", None) or dtype_name(getattr(t, "dtype", None))
    info["target_weights"] = getattr(t, "weight_format", info["target_dtype"])  # e.g. GGUF blocks (quant.py)
    info["weight_plan"] = getattr(t, "weight_plan", info["target_weights"])  # the torch plan (plan.py)
    stored = torch.bfloat16 if dfolder is None else stored_dtype(tensors)  # a random draft holds bf16 values
    d = draft_backend(dfolder, dcfg, t, draft_device, draft_dtype_for(draft_dtype, dtype, draft_device, stored,
                                                                      info["target_dtype"], policy),
                      mask, tensors, info["notes"], policy)
    info["draft_dtype"] = dtype_name(getattr(d, "dtype", None))
    # how each model's steps run: "graphs" (captured, CUDA), "compiled" (torch.compile, captured on CUDA), "fixed"
    # (fixed shapes) or "eager" (torch_backend/steps.py)
    info["steps"] = {"target": getattr(t, "steps", "eager"), "draft": getattr(d, "steps", "eager")}
    # the rows of the target's head the draft scores: e.g. "8192 of 49152 rows" (models/draft_vocab.py)
    info["draft_head"] = f"{(dcfg.format.draft_vocab_size if policy.draft_vocab else None) or tcfg.vocab_size} " \
                         f"of {tcfg.vocab_size} rows"
    info.update(draft=str(dfolder) if dfolder else draft, draft_format=dcfg.format.describe(),
                draft_device=draft_device, block_size=dcfg.block_size,
                target_layer_ids=layer_ids, mask_token_id=mask, schedule=schedule)
    set_cpu_threads(cpu_threads, schedule, target_device, draft_device, info["notes"])
    info["block"] = block
    return Loaded(t, d, tokenizer, stop_ids(tcfg, tokenizer, folder), info, block, folder, dfolder)


def load_tokenizer(folder: Path):
    """The target's tokenizer; a folder without one is named as such (transformers would otherwise
    blame sentencepiece or tiktoken)."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(f"target folder {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                                 "copy the tokenizer files from the model's repository into that folder")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except StrictDataclassError as e:  # transformers checks config.json as it reads it (e.g. heads that split hidden_size)
        why = str(e.__cause__ or e).splitlines()[0]
        raise ConfigError(f"{folder / 'config.json'} is inconsistent: {why}",
                          "fix config.json to match the weights (or re-download the model)") from None
    except (OSError, ValueError, TypeError, ImportError) as e:
        raise ModelNotFoundError(f"the tokenizer in {folder} cannot be loaded ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})",
                                 "copy complete tokenizer files from the model's repository into that folder") from None


def set_cpu_threads(threads: int | None, schedule: str, target_device: str, draft_device: str,
                    notes: list[str]) -> None:
    """Two lanes on the CPU at once must split the cores: two torch thread pools each as wide as the
    machine slow each other down many times over (measured 10-25x on 2 cores)."""
    if threads is None and schedule != "sequential" and cpu_bound(target_device) and cpu_bound(draft_device):
        threads = max(1, (os.cpu_count() or 2) // 2)
        if torch.get_num_threads() > threads:
            notes.append(f"target and draft both on the CPU under the {schedule} schedule: "
                         f"torch uses {threads} thread(s) per lane so they do not oversubscribe the cores")
    if threads is not None:
        torch.set_num_threads(threads)


def gguf_target_notes(target: str, device: str, dtype) -> list[str]:
    if target == "default" or not target.endswith(".gguf"):
        return []
    gguf = Path(target).expanduser()
    return gguf_notes(target, device, dtype, gguf.is_file() and is_converted(gguf))


def shipped(name: str):
    folder = resources.files("hetero_sd.data").joinpath("drafts", SHIPPED_DRAFTS[name])
    return folder if folder.joinpath("config.json").is_file() else None


def default_draft(draft: str | None, target: str, notes: list[str]) -> str | None:
    """"default" means the best draft shipped for the default target: the trained default when it ships,
    else the weaker "cpu-trained" one, which the block-size controller keeps from slowing decoding down."""
    if draft in (None, "none"):
        return None
    if draft == "auto":  # the published draft of a known target (pairs.py)
        draft = "default" if target == "default" else auto_draft(target)
        notes.append(f"draft 'auto': {draft}, the draft published for {target}")
    if draft not in SHIPPED_DRAFTS:
        return draft
    if target == "default":
        folder = shipped(draft) or (shipped("cpu-trained") if draft == "default" else None)
        if folder is not None:
            if folder == shipped("cpu-trained"):
                notes.append(cpu_trained_note(folder))
            return str(folder)
    if draft == "cpu-trained":
        raise ConfigError(f"the cpu-trained draft belongs to the default target ({DEFAULT_TARGET}), not {target}",
                          "pass a DFlash draft folder trained for this target (hetero-sd train-draft)")
    notes.append("no trained DFlash draft ships for this target yet: decoding autoregressively "
                 "(pass a draft folder, or draft='random' to exercise the speculative path)")
    return None


def cpu_trained_note(folder) -> str:
    """What the shipped draft is and how often its first guess is right on held-out answers (held_out.json beside
    it: simulated decoding, benchmarks/eval_heldout.py), so that a user reading tau has the draft's own bar."""
    done = json.loads(folder.joinpath("training.json").read_text())
    block = done["config"].get("block_size", 16)
    note = f"draft 'cpu-trained': trained on a 2-core CPU (its last run: {done['step']} steps at block {block})"
    held = folder / "held_out.json"
    if held.is_file():
        h = json.loads(held.read_text())
        right, floor = h["position_1_right"], h["ngram_floor"]
        note += (f"; on held-out answers its first guess is right {right['chat']:.0%} of the time on chat and "
                 f"{right['code']:.0%} on code (a 1-3-gram table: {floor['chat']:.0%} / {floor['code']:.0%})")
    return note + "; with block size 'auto' the controller decodes plainly wherever blocks do not pay"


def draft_source(draft: str, tcfg: ArchConfig, tokenizer, notes: list[str]) -> tuple[DraftConfig, dict, Path | None]:
    if draft == "random" or draft.startswith("random:"):
        layers = random_layers(draft)
        notes.append("the draft is randomly initialised (untrained): expect tau ~1 and a slowdown; "
                     "it measures costs and exercises the machinery")
        raw = draft_config(tcfg, num_layers=layers, block_size=16,
                           mask_token_id=pick_mask_token(tokenizer))
        tensors = {k: v.to(torch.bfloat16).float() for k, v in random_draft_tensors(raw).items()}
        return DraftConfig.from_dict(raw), tensors, None
    dfolder = resolve_folder(draft, "draft")
    dcfg = DraftConfig.from_folder(dfolder)
    if dcfg.arch.hidden_size != tcfg.hidden_size:  # say "mismatch" before any shape error in the weights
        check_pair(dcfg, tcfg, dcfg.mask_token_id)
    return dcfg, read_tensors(dfolder, dcfg), dfolder


def random_layers(draft: str) -> int:
    count = draft.partition(":")[2] or str(RANDOM_DRAFT_LAYERS)
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"bad random draft {draft!r}", "use 'random' or 'random:N' with N >= 1 layers")
    return int(count)


def stop_ids(cfg: ArchConfig, tokenizer, folder: Path) -> list[int]:
    ids = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = read_json(gen).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)
