"""The training loop for `hetero-sd train-draft`.

Data: prompts answered by the target itself (train/data.py). Features: the target's hidden states at the
draft's layers, computed once per sequence with our torch target, kept in memory (bf16) and, with a
feature cache, on disk (train/features.py) so later epochs never run the target again. Each step trains
every anchor among a sequence's response tokens (or `anchors` random ones), all blocks of a sequence in one
forward with attention split into block-vs-context and within-block parts (train/fast.py), and weights
the cross-entropy at block position k by exp(-(k-1)/gamma), computed in chunks (train/loss.py)."""

from __future__ import annotations

import json
import math
import pickle
import random
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from hetero_sd.backends.policy import DEFAULT as DEFAULT_POLICY
from hetero_sd.backends.torch_backend import load_target
from hetero_sd.errors import ConfigError
from hetero_sd.models.config import ArchConfig, fallback_layer_ids, read_json
from hetero_sd.models.draft_init import draft_config, pick_mask_token, write_draft
from hetero_sd.models.draft_format import SHORT_BLOCKS

from .fast import SplitForward, supports
from .features import FeatureStore
from .loss import chunked_cross_entropy, default_chunk
from .model import TrainingDraft, TrainingVocab


@dataclass
class TrainConfig:
    block_size: int = 16
    layers: int = 2
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 50
    accumulate: int = 4  # sequences per optimizer step (the effective batch: gradients accumulate over them)
    anchors: int = 0  # blocks per sequence per step: 0 = every response token with a successor, else N random
    gamma: float | None = None  # loss decay; default 7 at block 16, 4 at block 8 (DFlash's training recipe)
    # share of blocks trained at a random shorter length (2..B-1, its rows past the length out of attention and
    # loss): the block-size controller drafts blocks of 2..B, and a draft trained only at B reads position 1
    # worse in a shorter block (fewer mask rows; docs/training.md)
    short_blocks: float = 0.0
    held_out: int = 24  # rows never trained on (the smallest key hashes: see split_held_out)
    eval_rows: int = 24  # of those, the ones the periodic teacher-forced tau reads (the rest: evaluate.py's)
    eval_every: int = 100
    seed: int = 0
    init: str = "target"  # "target": draft layers start as copies of the target's last layers; else a draft folder
    vocab: str = "data"  # "data": the loss's softmax runs over the tokens of the answers (TrainingVocab); "full"
    vocab_frequent: int = 0  # > 0: only this many most frequent answer tokens + each step's labels + negatives
    soft: float = 0.0  # weight of distillation from the target's distribution (0: hard labels only)
    soft_top_k: int = 32  # the target's distribution kept per position: its k most likely tokens
    snapshots: bool = False  # keep the draft of every evaluation (OUT/snapshots/step-N): a learning curve
    pack: int = 1  # sequences per forward, packed end to end (the step's `accumulate` split into packs)
    device: str = "cpu"  # "cpu", "cuda" or "mps": where the draft trains and the target makes features
    autocast: str = "auto"  # "bf16", "off", or "auto": bf16 where the device computes it natively
    attention: str = "auto"  # "split" (train/fast.py), "dense" (one masked matrix), auto: split where it applies
    attention_group: int = 0  # blocks per context group of the split attention (0: train/fast.py's per device)
    ce_chunk: int = 0  # rows per chunk of the chunked cross-entropy (0: train/loss.py's per device)
    feature_cache: str | None = None  # a folder: target features kept on disk across epochs and runs
    feature_numerics: str = "float32"  # the target's rows for features: float32, or int8 (the runtime's CPU default)
    k_q8: bool = True  # int8 features: the K cache as q8_0 blocks where the CPU has VNNI (HETERO_SD_KV, passed down)
    prefetch: bool | None = None  # the next step's batches drawn on a helper thread (None: on a GPU, not the CPU)
    # a wall-clock budget (e.g. a rented GPU's time): the cosine runs over these minutes instead of `steps`, and the
    # run ends with an evaluation and a save when they are spent (or at `steps`, whichever comes first)
    minutes: float | None = None
    history: list = field(default_factory=list)

    def decay(self) -> float:
        return self.gamma or (7.0 if self.block_size >= 16 else 4.0 * self.block_size / 8)


class FeatureCache:
    """Target features per training sequence, computed on first use and kept (bf16) up to `budget_bytes`,
    least recently used dropped first. With the first recipe's 1,600 answers all fit; with data at scale
    (millions of tokens, ~5.8 KB of features per token for SmolLM2) they do not, and each sequence is
    seen only a few times, so recomputing costs little over caching."""

    def __init__(self, target_folder: Path, layer_ids: list[int], budget_bytes: int = 4 << 30, top_k: int = 0,
                 device: str = "cpu", disk: Path | None = None, numerics: str = "float32", batched: bool = False,
                 k_q8: bool = True):
        """numerics "int8": the features of the runtime's default CPU target of a GGUF (int8 rows x its blocks:
        ~4.4x fewer CPU-seconds per sequence than float32 rows on the 2-core Zen 5; a draft reads them alike,
        held out); kept in a store of their own. batched (float32 features, no soft
        labels): `prefetch` computes a step's new sequences in one padded forward of transformers' model of the
        target (on a GPU one sequence per forward is launch-bound; on the CPU our own target is faster).
        k_q8: the int8 target's K cache as q8_0 blocks where the CPU has AVX512-VNNI, as the runtime's default
        (False: float16, as the runtime under HETERO_SD_KV=float16); `kind` names what the features come from."""
        cfg = ArchConfig.from_dict(read_json(target_folder / "config.json"))
        self.target = load_target(target_folder, cfg, device, torch.float32, layer_ids, activations=numerics,
                                  policy=replace(DEFAULT_POLICY, k_q8=k_q8))
        self.layer_ids, self.batched = list(layer_ids), None
        if batched and numerics == "float32" and not top_k:
            from transformers import AutoModelForCausalLM
            self.batched = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32).to(device).eval()
        self.store: OrderedDict[int, tuple] = OrderedDict()
        self.budget, self.bytes, self.top_k = budget_bytes, 0, top_k
        # On disk: features only (soft labels need the target's logits, so they run the target anyway). A store
        # holds one target's: the int8 target with a q8_0 K cache (the default on CPUs with AVX512-VNNI) is named so.
        self.kind = numerics + ", q8_0 K" * bool(getattr(getattr(self.target, "cache", None), "k_q8", False))
        self.disk = None if disk is None or top_k else FeatureStore.for_target(
            Path(disk), target_folder, layer_ids, len(layer_ids) * cfg.hidden_size, self.kind)
        self.computed, self.compute_cpu_s = 0, 0.0  # target forwards run, and their CPU seconds

    def __call__(self, index: int, tokens: list[int], key: str | None = None) -> torch.Tensor:
        if self.disk is not None and index not in self.store:
            key = key or f"row:{index}"
            stored = self.disk.get(key, tokens)
            if stored is None:
                stored = self.compute(tokens)[0]
                self.disk.put(key, tokens, stored)
            return stored.to(self.target.device).float()
        return self.entry(index, tokens)[0].float()

    def prefetch(self, items: list[tuple[int, list[int], str | None]]) -> None:
        """(index, tokens, key) of a step's sequences: those neither in memory nor on disk are computed in one
        padded forward (right-padded: a causal model's real positions never see the pads) and kept."""
        if self.batched is None:
            return
        fresh = {i: (t, k or f"row:{i}") for i, t, k in items if i not in self.store}  # a row drawn twice: once
        todo = [(i, t, k) for i, (t, k) in fresh.items() if self.disk is None or not self.disk.has(k, t)]
        if not todo:
            return
        cpu0, dev = time.process_time(), self.target.device
        longest = max(len(t) for _, t, _ in todo)
        ids = torch.zeros(len(todo), longest, dtype=torch.long)
        mask = torch.zeros(len(todo), longest, dtype=torch.long)
        for row, (_, t, _) in enumerate(todo):
            ids[row, :len(t)], mask[row, :len(t)] = torch.tensor(t), 1
        with torch.no_grad():
            states = self.batched(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True,
                                  logits_to_keep=1).hidden_states  # [embeddings, layer 0, ...]: layer i is i + 1
            # (the last layer's entry is after the final norm, as feature_parts arranges ours)
            feats = torch.cat([states[i + 1] for i in self.layer_ids], -1).to(torch.bfloat16)
        for row, (index, t, key) in enumerate(todo):
            entry = feats[row, :len(t)].clone()
            if self.disk is not None:
                self.disk.put(key, t, entry)
            else:
                self.keep(index, (entry,))
        self.computed += len(todo)
        self.compute_cpu_s += time.process_time() - cpu0

    def compute(self, tokens: list[int]) -> tuple:
        """The target's forward: features (bf16) and, with top_k, its top-k log-probabilities and ids."""
        cpu0 = time.process_time()
        self.target.crop(0)
        out = self.target.forward(tokens, last_only=self.top_k == 0)
        entry = (out.features.to(torch.bfloat16),)
        if self.top_k:
            logp, ids = out.logits.log_softmax(-1).topk(self.top_k, -1)
            entry += (logp.to(torch.bfloat16), ids.to(torch.int32))
        self.computed += 1
        self.compute_cpu_s += time.process_time() - cpu0
        return entry

    def teacher(self, index: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k log-probabilities and token ids [S, k] at every position (position p: the
        distribution of token p+1), from the same forward as the features."""
        _, logp, ids = self.entry(index, tokens)
        return logp.float(), ids.long()

    def entry(self, index: int, tokens: list[int]) -> tuple:
        if index in self.store:
            self.store.move_to_end(index)
            return self.store[index]
        return self.keep(index, self.compute(tokens))

    def keep(self, index: int, entry: tuple) -> tuple:
        self.store[index] = entry
        self.bytes += sum(t.numel() * t.element_size() for t in entry)
        while self.bytes > self.budget and len(self.store) > 1:
            _, old = self.store.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)
        return entry


def split_held_out(rows: list[dict], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(held out, the rest in a seeded order). Rows with a prompt key (the distillation shards) are held
    out by a hash of the key: the `count` smallest hashes. As the shards grow that threshold only falls,
    so a row trained on in an earlier run never becomes a held-out row later. Rows of several stores
    (a `store` number each) are held out store by store, `count` each: a store's held-out rows stay the same
    whatever other stores are trained beside it."""
    if len({r.get("store") for r in rows}) > 1:
        held, rest = [], []
        for store in sorted({r.get("store") for r in rows}, key=str):
            h, r = split_held_out([x for x in rows if x.get("store") == store], count, seed)
            held, rest = held + h, rest + r
        random.Random(seed).shuffle(rest)
        return held, rest
    rows = sorted(rows, key=lambda r: r["index"])
    if rows and all("key" in r for r in rows):
        by_hash = sorted(rows, key=lambda r: zlib.crc32(r["key"].encode()))
        held = by_hash[:count]
        chosen = {id(r) for r in held}
        rest = [r for r in rows if id(r) not in chosen]
        random.Random(seed).shuffle(rest)
        return held, rest
    random.Random(seed).shuffle(rows)
    return rows[:count], rows[count:]


def choose_layers(num_target_layers: int, draft_layers: int) -> list[int]:
    """Five feature layers spread as the reference does, the last one feeding the copied layers."""
    ids = fallback_layer_ids(num_target_layers, 5)
    last = num_target_layers - draft_layers - 1
    return sorted(set([i for i in ids[:-1] if i < last] + [last]))


def feature_layers(num_target_layers: int, draft_layers: int, resumed: Path | None = None,
                   init: Path | None = None) -> list[int]:
    """The target layers a run's draft reads: a resumed run's own, else its init draft's (a deeper draft grown
    from a shallower one reads the features the old one was trained on), else choose_layers'."""
    for folder in (resumed, init):
        if folder is not None and (folder / "config.json").is_file():
            return list(read_json(folder / "config.json")["dflash_config"]["target_layer_ids"])
    return choose_layers(num_target_layers, draft_layers)


def init_from_target(model: TrainingDraft, target_tensors: dict, num_target_layers: int) -> None:
    """Draft layer i <- target layer N-L+i; fc picks the feature of the layer feeding them."""
    h, w = model.cfg.arch.hidden_size, dict(model.named_parameters())
    first = num_target_layers - model.cfg.arch.num_hidden_layers
    with torch.no_grad():
        w["fc.weight"].zero_()
        w["fc.weight"][:, -h:] = torch.eye(h)
        w["hidden_norm.weight"].copy_(target_tensors[f"model.layers.{first}.input_layernorm.weight"])
        w["norm.weight"].copy_(target_tensors["model.norm.weight"])
        for name, p in w.items():
            if name.startswith("layers."):
                i, rest = name.removeprefix("layers.").split(".", 1)
                src = f"model.layers.{first + int(i)}.{rest}"
                if src in target_tensors:
                    p.copy_(target_tensors[src])


def init_from_draft(model: TrainingDraft, folder: Path, raw: dict, target_folder: Path | None = None) -> None:
    """Warm start from an earlier draft of the same shape (e.g. continue `cpu-trained` on new data): its
    config must agree on everything that shapes the weights or the features they read. Or a DEEPER draft
    grown from it (`--layers` above the old draft's): its layers come first, and each new layer is appended
    as an exact identity, a copy of a target layer with its two output projections (o_proj, down_proj) zeroed:
    the grown draft starts as the old one's function, and the zeroed matrices are the first to get gradients
    (the residual branch's output); the new layers read the old draft's feature layers."""
    from safetensors.torch import load_file
    old = read_json(folder / "config.json")
    grow = raw["num_hidden_layers"] - old.get("num_hidden_layers", 0)
    if grow > 0:
        old = dict(old, num_hidden_layers=raw["num_hidden_layers"])
    # block_size shapes no weight either (a block is rows of the same layers): a block-16 draft may go on at 8
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "dflash_config")
    # the head's reduced vocabulary (models/draft_vocab.py) and short-block training shape no trained weight
    plain = lambda c: {k: v for k, v in c.items() if k not in ("draft_vocab_size", SHORT_BLOCKS)} \
        if isinstance(c, dict) else c  # noqa: E731
    differ = [k for k in keys if plain(old.get(k)) != plain(raw.get(k))]
    if differ:
        raise ConfigError(f"--init-from {folder}: its config differs in {', '.join(differ)}",
                          "train with the same --layers/--block-size, or start from the target")
    tensors = load_file(str(folder / "model.safetensors"))
    missing = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False).missing_keys
    if grow > 0:
        missing = grow_layers(model, missing, raw["num_hidden_layers"] - grow, target_folder)
    if missing:
        raise ConfigError(f"--init-from {folder}: tensors missing: {', '.join(missing[:4])}",
                          "give a DFlash draft folder written by train-draft")


def grow_layers(model: TrainingDraft, missing: list[str], first_new: int, target_folder: Path | None) -> list[str]:
    """Layers first_new.. of a grown draft (init_from_draft): copies of the target's last layers, o_proj and
    down_proj zeroed. Returns the tensors still missing (none when the target has every one)."""
    from hetero_sd.models.weights import load_weights
    if target_folder is None:
        return missing
    target, w = load_weights(target_folder), dict(model.named_parameters())
    n_draft = model.cfg.arch.num_hidden_layers
    n_target = ArchConfig.from_dict(read_json(target_folder / "config.json")).num_hidden_layers
    left = []
    with torch.no_grad():
        for name in missing:
            i, rest = name.removeprefix("layers.").split(".", 1) if name.startswith("layers.") else (None, name)
            if i is None or int(i) < first_new:
                left.append(name)
                continue
            p = w[name]
            src = f"model.layers.{n_target - n_draft + int(i)}.{rest}"
            if rest.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif src in target:
                p.copy_(target[src])
            elif rest.endswith(("q_norm.weight", "k_norm.weight")):  # a Llama target has none: Qwen3 norms start at 1
                p.fill_(1.0)
            else:
                left.append(name)
    return left


def sample_anchors(rng: random.Random, prompt_len: int, seq_len: int, count: int) -> torch.Tensor:
    """`count` random anchors among the response tokens with a successor; all of them for count 0."""
    choices = list(range(prompt_len, seq_len - 1))
    if count <= 0:
        return torch.tensor(choices, dtype=torch.long)
    return torch.tensor(sorted(rng.sample(choices, min(count, len(choices)))), dtype=torch.long)


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block: int, ends: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Labels [n, B-1]: the tokens at anchor+1..anchor+B-1; -100 past the end of the anchor's sequence
    (`ends` [n] where sequences are packed, else the end of `tokens`) and past a short block's length."""
    offsets = torch.arange(1, block, device=anchors.device)
    pos = anchors[:, None] + offsets
    end = tokens.shape[0] if ends is None else ends[:, None]
    keep = pos < end
    if lengths is not None:
        keep = keep & (offsets[None, :] < lengths[:, None])
    return torch.where(keep, tokens[pos.clamp_max(tokens.shape[0] - 1)], -100)


def block_lengths(rng: random.Random, count: int, block: int, share: float) -> torch.Tensor | None:
    """Per block its length: B, or with probability `share` one of 2..B-1 (uniform); None when share is 0."""
    if share <= 0 or block <= 2:
        return None
    return torch.tensor([rng.randint(2, block - 1) if rng.random() < share else block for _ in range(count)])


@dataclass
class Batch:
    """Sequences packed end to end for one forward: per anchor, its sequence's start and end."""

    features: torch.Tensor  # [S, L*H]
    tokens: torch.Tensor  # [S]
    anchors: torch.Tensor  # [n]
    starts: torch.Tensor  # [n]
    ends: torch.Tensor  # [n]
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None  # the target's top-k log-probs and ids [S, k]
    lengths: torch.Tensor | None = None  # [n] each block's length (None: all B; see TrainConfig.short_blocks)


def make_batch(rows: list[dict], count: int, rng: random.Random, anchors: int, features, soft: bool,
               device, block: int = 0, short: float = 0.0) -> Batch:
    """`count` sequences drawn from `rows`, each with its random anchors, packed for one forward."""
    parts, offset = {"features": [], "tokens": [], "anchors": [], "starts": [], "ends": [], "logp": [], "ids": []}, 0
    drawn = []
    for _ in range(count):  # rows and anchors first (the same random stream as drawing them one by one) ...
        row = rng.choice(rows)
        ids = row["prompt_ids"] + row["response_ids"]
        drawn.append((row, ids, sample_anchors(rng, len(row["prompt_ids"]), len(ids), anchors)))
    if hasattr(features, "prefetch"):  # ... so that a batched feature cache computes the new ones at once
        features.prefetch([(row["index"], ids, row.get("key")) for row, ids, _ in drawn])
    for row, ids, chosen in drawn:
        parts["features"].append(features(row["index"], ids, row.get("key")))
        parts["tokens"].append(torch.tensor(ids))
        parts["anchors"].append(chosen + offset)
        parts["starts"].append(torch.full_like(chosen, offset))
        parts["ends"].append(torch.full_like(chosen, offset + len(ids)))
        if soft:
            logp, top = features.teacher(row["index"], ids)
            parts["logp"].append(logp)
            parts["ids"].append(top)
        offset += len(ids)
    cat = {k: torch.cat(v).to(device) for k, v in parts.items() if v}
    teacher = (cat["logp"], cat["ids"]) if soft else None
    lengths = block_lengths(rng, int(cat["anchors"].shape[0]), block, short)
    return Batch(cat["features"], cat["tokens"], cat["anchors"], cat["starts"], cat["ends"], teacher,
                 None if lengths is None else lengths.to(device))


def loss_fn(model: TrainingDraft, batch: Batch, weights, vocab: TrainingVocab | None = None, soft: float = 0.0,
            split: SplitForward | None = None, chunk: int = 0):
    """Cross-entropy at each block position, weighted by position; with the batch's teacher (the target's
    top-k log-probs and ids per position) and soft > 0, mixed with the cross-entropy against the target's
    own distribution there, renormalised over its top k (soft labels, as DFlash's training recipe allows).
    With `split` (sequences packed by their starts) the forward is train/fast.py's and, for hard labels, the
    cross-entropy is computed in chunks without holding every block's logits."""
    labels = block_labels(batch.tokens, batch.anchors, model.block_size, batch.ends, batch.lengths)
    head = model.lm_head if vocab is None else vocab.head
    if split is not None:
        hidden = split(batch.features, batch.tokens, batch.anchors, batch.lengths, batch.starts)
    else:
        hidden = model(batch.features, batch.tokens, batch.anchors, batch.starts)
    if split is not None and not (batch.teacher is not None and soft > 0):
        hard_labels = labels if vocab is None else vocab.labels(labels)
        w = weights.expand_as(labels) * (hard_labels != -100)
        total = chunked_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head, hard_labels.flatten(), w.flatten(),
                                      chunk or default_chunk(model.device))
        return total / w.sum().clamp_min(1e-9)
    logits = model.logits(hidden, head)
    logq = logits.float().log_softmax(-1)
    hard_labels = labels if vocab is None else vocab.labels(labels)
    ce = -logq.gather(-1, hard_labels.clamp_min(0)[..., None])[..., 0]
    if batch.teacher is not None and soft > 0:
        ce = (1 - soft) * ce + soft * soft_ce(logq, batch.teacher, batch.anchors, model.block_size, vocab)
    w = weights.expand_as(labels) * (labels != -100) * (hard_labels != -100)
    return (ce * w).sum() / w.sum().clamp_min(1e-9)


def train_device(name: str, autocast: str) -> tuple[str, torch.dtype | None]:
    """The device to train on and the autocast dtype there (None: float32 throughout)."""
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()}
    if name not in available:
        raise ConfigError(f"--device {name}: not a training device", "use --device cpu, cuda or mps")
    if not available[name]:
        raise ConfigError(f"--device {name}: this torch build sees no {name} device",
                          "install a torch build for it, or train with --device cpu")
    if autocast not in ("auto", "bf16", "off"):
        raise ConfigError(f"--autocast {autocast}: unknown", "use --autocast auto, bf16 or off")
    if autocast == "auto":  # bf16 where the hardware computes it natively; emulated bf16 is slower
        return name, torch.bfloat16 if native_bf16(name) else None
    return name, torch.bfloat16 if autocast == "bf16" else None


def native_bf16(device: str) -> bool:
    """CUDA with bf16, or a CPU with AVX512-BF16 or AMX (an AVX2-only CPU, such as the 2-core EPYC this
    project is developed on, converts bf16 in software: float32 stays faster there)."""
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    if device == "cpu":
        cpu = torch.cpu
        return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def autocast_note(device: str, autocast: torch.dtype | None, asked: str) -> str:
    if autocast is not None:
        return f"bf16 autocast ({asked}), float32 master weights"
    if asked == "off":
        return "float32 (--autocast off)"
    return f"float32: no native bf16 on this {device}" + (" (AVX2 only)" if device == "cpu" else "")


def soft_ce(logq, teacher, anchors, block: int, vocab: TrainingVocab | None) -> torch.Tensor:
    """-sum_j p_j log q_j over the target's top-k tokens at each label position [n, B-1]. Label k of a
    block is token anchor+k; the target's distribution for it comes from position anchor+k-1. Tokens
    outside this step's training vocabulary drop out of p (which is renormalised)."""
    logp, ids = teacher
    pos = (anchors[:, None] + torch.arange(block - 1)).clamp_max(logp.shape[0] - 1)
    logp, ids = logp[pos], ids[pos]  # [n, B-1, k]
    cols = ids if vocab is None else vocab.index[ids]
    p = logp.softmax(-1) * (cols >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return -(p * logq.gather(-1, cols.clamp_min(0))).sum(-1)


@torch.no_grad()
def held_out_tau(model: TrainingDraft, rows, features, split: SplitForward | None = None) -> float:
    """Greedy acceptance on held-out sequences: anchors every B tokens, leading correct drafts + bonus."""
    lengths = []
    for row in rows:
        tokens = torch.tensor(row["prompt_ids"] + row["response_ids"], device=model.device)
        p, s, b = len(row["prompt_ids"]), tokens.shape[0], model.block_size
        anchors = torch.arange(p, s - 1, b, device=model.device)
        if not len(anchors):
            continue
        labels = block_labels(tokens, anchors, b)
        forward = split or model
        context = features(row["index"], tokens.tolist(), row.get("key"))
        guess = model.logits(forward(context, tokens, anchors)).argmax(-1)
        right = (guess == labels).int().cumprod(-1).sum(-1)
        lengths += (right + 1).tolist()
    return sum(lengths) / max(len(lengths), 1)


def check_packing(pack: int, accumulate: int) -> None:
    """A forward packs at most a step's sequences (--pack 32 with --accumulate 2 would train 2 a step, not 32)."""
    if pack > accumulate:
        raise ConfigError(f"--pack {pack} with --accumulate {accumulate}: a step has {accumulate} "
                          f"sequences, so no forward can pack {pack}",
                          f"raise --accumulate to a multiple of --pack (e.g. --accumulate {2 * pack}) or lower --pack")


def train(target_folder: Path, rows: list[dict], out: Path, cfg: TrainConfig, *, resume: bool = False,
          progress=None) -> dict:
    check_packing(cfg.pack, cfg.accumulate)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tcfg = ArchConfig.from_dict(read_json(target_folder / "config.json"))
    resumed = resume and (out / "checkpoint.pt").is_file()
    layer_ids = feature_layers(tcfg.num_hidden_layers, cfg.layers, out if resumed else None,
                               None if cfg.init == "target" else Path(cfg.init))
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(target_folder))
    raw = draft_config(tcfg, num_layers=cfg.layers, block_size=cfg.block_size,
                       mask_token_id=pick_mask_token(tokenizer), layer_ids=layer_ids)
    if cfg.short_blocks > 0:  # the runtime then drafts a short block with its own rows (DraftFormat.block_rows)
        raw["dflash_config"][SHORT_BLOCKS] = True
    device, autocast = train_device(cfg.device, cfg.autocast)
    features = FeatureCache(target_folder, layer_ids, top_k=cfg.soft_top_k if cfg.soft > 0 else 0, device=device,
                            disk=Path(cfg.feature_cache) if cfg.feature_cache else None,
                            numerics=cfg.feature_numerics, batched=device != "cpu", k_q8=cfg.k_q8)
    model = TrainingDraft(raw, features.target.embed, features.target.lm_head.t())
    split = attention_path(model, cfg)
    if cfg.short_blocks and split is None:
        raise ConfigError("--short-blocks needs the split attention (train/fast.py), which this draft or "
                          "--attention does not use", "train without --short-blocks, or with --attention split")
    held, rest = split_held_out(rows, cfg.held_out, cfg.seed)
    train_rows = [r for r in rest if len(r["response_ids"]) > 1]
    vocab = TrainingVocab(train_rows, model.lm_head, frequent=cfg.vocab_frequent or None) \
        if cfg.vocab == "data" else None
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: lr_factor(step, cfg))
    out.mkdir(parents=True, exist_ok=True)
    start, checkpoint = 0, out / "checkpoint.pt"
    if resume and checkpoint.is_file():
        state = load_checkpoint(checkpoint)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start, cfg.history = state["step"], state["history"]
        rng.setstate(state["rng"])
        if "schedule" in state:  # checkpoints before the LambdaLR schedule resume at their step
            schedule.load_state_dict(state["schedule"])
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        for group in optim.param_groups:
            group["lr"] = cfg.lr * lr_factor(start, cfg)  # a changed --steps or --lr applies from here on
        schedule.last_epoch, schedule.base_lrs = start, [cfg.lr] * len(optim.param_groups)
    elif cfg.init == "target":
        from hetero_sd.models.weights import load_weights
        init_from_target(model, load_weights(target_folder), tcfg.num_hidden_layers)
    else:
        init_from_draft(model, Path(cfg.init), raw, target_folder)
    notes = {"autocast": autocast_note(device, autocast, cfg.autocast),
             "attention": "split (block vs context + within block)" if split else "dense (one masked matrix)",
             "loss": "chunked cross-entropy" if split and cfg.soft == 0 else "cross-entropy over all logits",
             "features": ("a step's new sequences in one padded forward of transformers' model of the target; "
                          if features.batched is not None else "") +
                         (f"on disk in {cfg.feature_cache}" if features.disk is not None else
                          "in memory" + (" (--feature-cache not used: soft labels need the target's logits, "
                                         "so its forward runs every time)" if cfg.feature_cache else ""))}
    weights = torch.exp(-torch.arange(cfg.block_size - 1, device=device) / cfg.decay())
    last = cfg.history[-1] if cfg.history else {}
    began, cpu0 = time.perf_counter(), time.process_time() - last.get("cpu_s", 0)
    blocks_total = last.get("blocks_total", 0)
    counts = [min(cfg.pack, cfg.accumulate - first) for first in range(0, cfg.accumulate, cfg.pack)]

    def draw_batches() -> list[Batch]:
        return [make_batch(train_rows, count, rng, cfg.anchors, features, cfg.soft > 0, device, cfg.block_size,
                           cfg.short_blocks) for count in counts]
    # On a GPU the next step's batches (rows, anchors, their features' forward, the copies) are drawn on a helper
    # thread while this step computes (on an H200 the host's ~0.24 s a step sat beside a 0.51 s step). The random
    # stream is drawn in the same order (step s+1's batches after step s's vocabulary), and a checkpoint keeps the
    # stream as it was before the prefetch, so a resumed run draws the same batches.
    helper = ThreadPoolExecutor(1) if (device != "cpu" if cfg.prefetch is None else cfg.prefetch) else None
    pending = None  # the next step's batches, being drawn
    try:
        for step in range(start, cfg.steps):
            spent = (time.perf_counter() - began) / 60 / cfg.minutes if cfg.minutes else 0.0
            if cfg.minutes:  # the time budget's cosine (warm-up still by steps)
                for group in optim.param_groups:
                    group["lr"] = cfg.lr * lr_factor(step, cfg, spent)
            last_step = step + 1 == cfg.steps or spent >= 1
            lr = optim.param_groups[0]["lr"]
            batches = pending.result() if pending is not None else draw_batches()
            if vocab is not None:  # after the batches: the step's labels join a frequent-tokens vocabulary
                vocab.draw(rng, torch.cat([block_labels(b.tokens, b.anchors, cfg.block_size, b.ends).flatten()
                                           for b in batches]) if cfg.vocab_frequent else None)
            stream = rng.getstate()  # what a checkpoint after this step resumes from
            pending = helper.submit(draw_batches) if helper is not None and not last_step else None
            total, blocks = optimizer_step(model, optim, counts, batches, weights, vocab, split, cfg, autocast)
            schedule.step()
            blocks_total += blocks
            record = {"step": step + 1, "loss": total, "lr": lr, "elapsed_s": time.perf_counter() - began,
                      "cpu_s": time.process_time() - cpu0,  # CPU seconds: the compute, whatever else ran
                      "blocks": blocks, "blocks_total": blocks_total, "features_computed": features.computed,
                      "features_cpu_s": round(features.compute_cpu_s, 2)}
            if (step + 1) % cfg.eval_every == 0 or last_step:
                if pending is not None:
                    pending.result()  # the evaluation reads the same feature cache: the helper done first
                if features.disk is not None:
                    features.disk.flush()
                record["held_out_tau"] = held_out_tau(model, held[:cfg.eval_rows], features, split)
                cfg.history.append(record)
                save(out, model, optim, schedule, step + 1, stream, cfg, raw, notes)
            with (out / "log.jsonl").open("a") as log:
                log.write(json.dumps(record) + "\n")
            if progress:
                progress(record)
            if last_step:
                break
    finally:
        if helper is not None:
            helper.shutdown(wait=True, cancel_futures=True)
    if features.disk is not None:
        features.disk.flush()
    return {"draft": str(out), "history": cfg.history, "notes": notes}


def optimizer_step(model, optim, counts, batches, weights, vocab, split, cfg: TrainConfig, autocast) -> tuple[float, int]:
    """One step over its packed forwards (`counts` sequences each): gradients accumulated, clipped, applied.
    Returns the step's loss and its blocks."""
    total, blocks = 0.0, 0
    device = model.device.type
    for count, batch in zip(counts, batches):
        blocks += int(batch.anchors.shape[0])
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_fn(model, batch, weights, vocab, cfg.soft, split, cfg.ce_chunk) * count / cfg.accumulate
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return total, blocks


def lr_factor(step: int, cfg: TrainConfig, spent: float | None = None) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at `steps` (LambdaLR's multiplier), or over
    the time budget when `spent` (its share used, --minutes) is given."""
    progress = min(spent, 1.0) if spent is not None else min(step, cfg.steps) / cfg.steps
    return min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * progress))


def attention_path(model: TrainingDraft, cfg: TrainConfig) -> SplitForward | None:
    """train/fast.py's split attention where it computes this draft exactly, else the dense masked one."""
    if cfg.attention not in ("auto", "split", "dense"):
        raise ConfigError(f"--attention {cfg.attention}: unknown", "use --attention auto, split or dense")
    if cfg.attention == "split" and not supports(model.cfg):
        raise ConfigError(f"--attention split: not for a {model.cfg.format.describe()} draft",
                          "use --attention dense (or auto)")
    if cfg.attention == "dense" or not supports(model.cfg):
        return None  # (training.json's notes name the path taken)
    return SplitForward(model, cfg.attention_group or None)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint holds tensors and plain values only; anything else (a pickle that would construct
    objects, i.e. run code) is refused, never executed."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not a checkpoint train-draft can load safely ({first[:160]})",
                          "delete it (and resume from an earlier one) or train into another --out") from None


def save(out: Path, model: TrainingDraft, optim, schedule, step: int, rng_state: tuple, cfg: TrainConfig,
         raw: dict, notes: dict | None = None) -> None:
    """A loadable z-lab folder at every evaluation, plus a resumable checkpoint (tensors and plain values
    only: it loads with weights_only=True), written to a temporary name and renamed."""
    out.mkdir(parents=True, exist_ok=True)
    write_draft(out, raw, {k: v.detach() for k, v in model.state_dict().items()})
    if cfg.snapshots:
        write_draft(out / "snapshots" / f"step-{step}", raw, {k: v.detach() for k, v in model.state_dict().items()})
    tmp = out / ".checkpoint.pt.tmp"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "schedule": schedule.state_dict(),
                "step": step, "rng": rng_state, "torch_rng": torch.get_rng_state(), "history": cfg.history},
               tmp)
    tmp.replace(out / "checkpoint.pt")
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "step": step, "notes": notes or {}},
                                                  indent=2))
