"""The training loop for `hetero-sd train-draft`.

Data: prompts answered by the target itself (train/data.py). Features: the target's hidden states at the
draft's layers, computed once per sequence with our torch target and kept in memory (bf16). Each step
samples random anchors among response tokens, runs all blocks of a sequence in one forward with the
block mask, and weights the cross-entropy at block position k by exp(-(k-1)/gamma)."""

from __future__ import annotations

import json
import math
import random
import time
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from hetero_sd.backends.torch_backend import load_target
from hetero_sd.errors import ConfigError
from hetero_sd.models.config import ArchConfig, fallback_layer_ids, read_json
from hetero_sd.models.draft_init import draft_config, pick_mask_token, write_draft

from .model import TrainingDraft, TrainingVocab


@dataclass
class TrainConfig:
    block_size: int = 16
    layers: int = 2
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 50
    accumulate: int = 4  # sequences per optimizer step
    anchors: int = 24  # blocks per sequence per step (fewer if the response is short)
    gamma: float | None = None  # loss decay; default 7 at block 16, 4 at block 8 (DFlash's training recipe)
    held_out: int = 24
    eval_every: int = 100
    seed: int = 0
    init: str = "target"  # "target": draft layers start as copies of the target's last layers; else a draft folder
    vocab: str = "data"  # "data": the loss's softmax runs over the tokens of the answers (TrainingVocab)
    soft: float = 0.0  # weight of distillation from the target's distribution (0: hard labels only)
    soft_top_k: int = 32  # the target's distribution kept per position: its k most likely tokens
    snapshots: bool = False  # keep the draft of every evaluation (OUT/snapshots/step-N): a learning curve
    pack: int = 1  # sequences per forward, packed end to end (the step's `accumulate` split into packs)
    device: str = "cpu"  # "cpu", "cuda" or "mps": where the draft trains and the target makes features
    autocast: str = "auto"  # "bf16", "off", or "auto": bf16 where the device computes it natively (CUDA)
    history: list = field(default_factory=list)

    def decay(self) -> float:
        return self.gamma or (7.0 if self.block_size >= 16 else 4.0 * self.block_size / 8)


class FeatureCache:
    """Target features per training sequence, computed on first use and kept (bf16) up to `budget_bytes`,
    least recently used dropped first. With the first recipe's 1,600 answers all fit; with data at scale
    (millions of tokens, ~5.8 KB of features per token for SmolLM2) they do not, and each sequence is
    seen only a few times, so recomputing costs little over caching."""

    def __init__(self, target_folder: Path, layer_ids: list[int], budget_bytes: int = 4 << 30, top_k: int = 0,
                 device: str = "cpu"):
        cfg = ArchConfig.from_dict(read_json(target_folder / "config.json"))
        self.target = load_target(target_folder, cfg, device, torch.float32, layer_ids)
        self.store: OrderedDict[int, tuple] = OrderedDict()
        self.budget, self.bytes, self.top_k = budget_bytes, 0, top_k

    def __call__(self, index: int, tokens: list[int]) -> torch.Tensor:
        return self.entry(index, tokens)[0].float()

    def teacher(self, index: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k log-probabilities and token ids [S, k] at every position (position p: the
        distribution of token p+1), from the same forward as the features."""
        _, logp, ids = self.entry(index, tokens)
        return logp.float(), ids.long()

    def entry(self, index: int, tokens: list[int]) -> tuple:
        if index in self.store:
            self.store.move_to_end(index)
            return self.store[index]
        self.target.crop(0)
        out = self.target.forward(tokens, last_only=self.top_k == 0)
        entry = (out.features.to(torch.bfloat16),)
        if self.top_k:
            logp, ids = out.logits.log_softmax(-1).topk(self.top_k, -1)
            entry += (logp.to(torch.bfloat16), ids.to(torch.int32))
        self.store[index] = entry
        self.bytes += sum(t.numel() * t.element_size() for t in entry)
        while self.bytes > self.budget and len(self.store) > 1:
            _, old = self.store.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)
        return entry


def split_held_out(rows: list[dict], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(held out, the rest in a seeded order). Rows with a prompt key (the distillation shards) are held
    out by a hash of the key: the `count` smallest hashes. As the shards grow that threshold only falls,
    so a row trained on in an earlier session never becomes a held-out row later."""
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


def init_from_target(model: TrainingDraft, target_tensors: dict, num_target_layers: int) -> None:
    """Draft layer i <- target layer N-L+i; fc picks the feature of the layer feeding them."""
    h, w = model.cfg.arch.hidden_size, model.tensors
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


def init_from_draft(model: TrainingDraft, folder: Path, raw: dict) -> None:
    """Warm start from an earlier draft of the same shape (e.g. continue `cpu-trained` on new data): its
    config must agree on everything that shapes the weights or the features they read."""
    from safetensors.torch import load_file
    old = read_json(folder / "config.json")
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "block_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "dflash_config")
    differ = [k for k in keys if old.get(k) != raw.get(k)]
    if differ:
        raise ConfigError(f"--init-from {folder}: its config differs in {', '.join(differ)}",
                          "train with the same --layers/--block-size, or start from the target")
    tensors = load_file(str(folder / "model.safetensors"))
    missing = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False).missing_keys
    if missing:
        raise ConfigError(f"--init-from {folder}: tensors missing: {', '.join(missing[:4])}",
                          "give a DFlash draft folder written by train-draft")


def sample_anchors(rng: random.Random, prompt_len: int, seq_len: int, count: int) -> torch.Tensor:
    choices = list(range(prompt_len, seq_len - 1))  # anchors are response tokens with a successor
    return torch.tensor(sorted(rng.sample(choices, min(count, len(choices)))), dtype=torch.long)


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block: int, ends: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Labels [n, B-1]: the tokens at anchor+1..anchor+B-1; -100 past the end of the anchor's sequence
    (`ends` [n] where sequences are packed, else the end of `tokens`)."""
    pos = anchors[:, None] + torch.arange(1, block, device=anchors.device)
    end = tokens.shape[0] if ends is None else ends[:, None]
    return torch.where(pos < end, tokens[pos.clamp_max(tokens.shape[0] - 1)], -100)


@dataclass
class Batch:
    """Sequences packed end to end for one forward: per anchor, its sequence's start and end."""

    features: torch.Tensor  # [S, L*H]
    tokens: torch.Tensor  # [S]
    anchors: torch.Tensor  # [n]
    starts: torch.Tensor  # [n]
    ends: torch.Tensor  # [n]
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None  # the target's top-k log-probs and ids [S, k]


def make_batch(rows: list[dict], count: int, rng: random.Random, anchors: int, features, soft: bool,
               device) -> Batch:
    """`count` sequences drawn from `rows`, each with its random anchors, packed for one forward."""
    parts, offset = {"features": [], "tokens": [], "anchors": [], "starts": [], "ends": [], "logp": [], "ids": []}, 0
    for _ in range(count):
        row = rng.choice(rows)
        ids = row["prompt_ids"] + row["response_ids"]
        chosen = sample_anchors(rng, len(row["prompt_ids"]), len(ids), anchors)
        parts["features"].append(features(row["index"], ids))
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
    return Batch(cat["features"], cat["tokens"], cat["anchors"], cat["starts"], cat["ends"], teacher)


def loss_fn(model: TrainingDraft, batch: Batch, weights, vocab: TrainingVocab | None = None, soft: float = 0.0):
    """Cross-entropy at each block position, weighted by position; with the batch's teacher (the target's
    top-k log-probs and ids per position) and soft > 0, mixed with the cross-entropy against the target's
    own distribution there, renormalised over its top k (soft labels, as DFlash's training recipe allows)."""
    labels = block_labels(batch.tokens, batch.anchors, model.block_size, batch.ends)
    head = None if vocab is None else vocab.head
    logits = model.logits(model(batch.features, batch.tokens, batch.anchors, batch.starts), head)
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
    if autocast == "auto":  # CUDA tensor cores compute bf16 natively; elsewhere float32 measured as fast
        native = name == "cuda" and torch.cuda.is_bf16_supported()
        return name, torch.bfloat16 if native else None
    return name, torch.bfloat16 if autocast == "bf16" else None


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
def held_out_tau(model: TrainingDraft, rows, features) -> float:
    """Greedy acceptance on held-out sequences: anchors every B tokens, leading correct drafts + bonus."""
    lengths = []
    for row in rows:
        tokens = torch.tensor(row["prompt_ids"] + row["response_ids"], device=model.device)
        p, s, b = len(row["prompt_ids"]), tokens.shape[0], model.block_size
        anchors = torch.arange(p, s - 1, b, device=model.device)
        if not len(anchors):
            continue
        labels = block_labels(tokens, anchors, b)
        guess = model.logits(model(features(row["index"], tokens.tolist()), tokens, anchors)).argmax(-1)
        right = (guess == labels).int().cumprod(-1).sum(-1)
        lengths += (right + 1).tolist()
    return sum(lengths) / max(len(lengths), 1)


def train(target_folder: Path, rows: list[dict], out: Path, cfg: TrainConfig, *, resume: bool = False,
          progress=None) -> dict:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tcfg = ArchConfig.from_dict(read_json(target_folder / "config.json"))
    layer_ids = choose_layers(tcfg.num_hidden_layers, cfg.layers)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(target_folder))
    raw = draft_config(tcfg, num_layers=cfg.layers, block_size=cfg.block_size,
                       mask_token_id=pick_mask_token(tokenizer), layer_ids=layer_ids)
    device, autocast = train_device(cfg.device, cfg.autocast)
    features = FeatureCache(target_folder, layer_ids, top_k=cfg.soft_top_k if cfg.soft > 0 else 0, device=device)
    model = TrainingDraft(raw, features.target.embed, features.target.lm_head.t())
    held, rest = split_held_out(rows, cfg.held_out, cfg.seed)
    train_rows = [r for r in rest if len(r["response_ids"]) > 1]
    vocab = TrainingVocab(train_rows, model.lm_head) if cfg.vocab == "data" else None
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    out.mkdir(parents=True, exist_ok=True)
    start, checkpoint = 0, out / "checkpoint.pt"
    if resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start, cfg.history = state["step"], state["history"]
        rng.setstate(state["rng"])
    elif cfg.init == "target":
        from hetero_sd.models.weights import load_weights
        init_from_target(model, load_weights(target_folder), tcfg.num_hidden_layers)
    else:
        init_from_draft(model, Path(cfg.init), raw)
    weights = torch.exp(-torch.arange(cfg.block_size - 1, device=device) / cfg.decay())
    began, cpu0 = time.perf_counter(), time.process_time() - (cfg.history[-1].get("cpu_s", 0) if cfg.history else 0)
    for step in range(start, cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in optim.param_groups:
            group["lr"] = lr
        total = 0.0
        if vocab is not None:
            vocab.draw(rng)
        for first in range(0, cfg.accumulate, cfg.pack):
            count = min(cfg.pack, cfg.accumulate - first)
            batch = make_batch(train_rows, count, rng, cfg.anchors, features, cfg.soft > 0, device)
            with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = loss_fn(model, batch, weights, vocab, cfg.soft) * count / cfg.accumulate
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        record = {"step": step + 1, "loss": total, "lr": lr, "elapsed_s": time.perf_counter() - began,
                  "cpu_s": time.process_time() - cpu0}  # CPU seconds: the compute, whatever else ran
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record["held_out_tau"] = held_out_tau(model, held, features)
            cfg.history.append(record)
            save(out, model, optim, step + 1, rng, cfg, raw)
        with (out / "log.jsonl").open("a") as log:
            log.write(json.dumps(record) + "\n")
        if progress:
            progress(record)
    return {"draft": str(out), "history": cfg.history}


def save(out: Path, model: TrainingDraft, optim, step: int, rng: random.Random, cfg: TrainConfig,
         raw: dict) -> None:
    """A loadable z-lab folder at every evaluation, plus a resumable checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    write_draft(out, raw, {k: v.detach() for k, v in model.state_dict().items()})
    if cfg.snapshots:
        write_draft(out / "snapshots" / f"step-{step}", raw, {k: v.detach() for k, v in model.state_dict().items()})
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step, "rng": rng.getstate(),
                "history": cfg.history}, out / "checkpoint.pt")
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "step": step}, indent=2))
