"""Tiny random drafts made with z-lab's reference classes (the `dflash` package), and the reference's
own first block and generation, for parity tests."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import dflash.model as ref

MASK, BLOCK, LAYER_IDS = 3, 6, [0, 2, 3]
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}


def make_reference_draft(folder: Path, dflash2: bool = False, seed: int = 0, config=None, dflash_config=None, vocab: int = 64,
                         published_names: bool = True):
    """A 2-layer draft for the tiny 64-wide, 4-layer, 64-token targets of conftest, built with the
    reference's classes, randomised (std 0.2 matrices, norms near 1, selector scores as large as the
    logits so that the selector changes tokens), saved with save_pretrained. published_names: rename the
    codebooks without `.weight`, as published DFlash2 checkpoints name them."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      **(config or {}))
    cfg.num_target_layers, cfg.block_size = 4, BLOCK
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, **(DFLASH2 if dflash2 else {}),
                         **(dflash_config or {})}
    model = (ref.DFlash2DraftModel if dflash2 else ref.DFlashDraftModel)(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 if "candidate_selector" in name else 0.2))
    model.save_pretrained(str(folder))
    if published_names and dflash2:
        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        save_file({k.removesuffix(".weight") if "codebook" in k else k: v for k, v in tensors.items()},
                  str(path), metadata={"format": "pt"})
    return model


def hf_target(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.inference_mode()
def first_block(model, target, prompt: list[int]):
    """The reference's first block after a greedy prefill: (tokens, logits [B-1, vocab])."""
    ids = torch.tensor([prompt])
    out = target(ids, output_hidden_states=True)
    anchor = out.logits[0, -1].argmax()
    features = ref.extract_context_feature(out.hidden_states, model.target_layer_ids)
    block = torch.full((1, model.block_size), model.mask_token_id)
    block[0, 0] = anchor
    scale = float(ref._draft_value(model.config, "input_embedding_scale", 1.0))
    noise = F.embedding(block, target.get_input_embeddings().weight) * scale
    hidden = model(target_hidden=features, noise_embedding=noise,
                   position_ids=torch.arange(len(prompt) + model.block_size)[None],
                   past_key_values=ref._make_cache(model.config), use_cache=True)[:, 1:]
    head = ref._output_head(target)
    logits = model.compute_logits(hidden, head)
    if isinstance(model, ref.DFlash2DraftModel):
        tokens = model.propose(hidden, block[:, 0], head, 0.0)[0]
    else:
        tokens = logits.argmax(-1)
    return tokens[0].tolist(), logits[0].float()


def generate(model, target, prompt: list[int], max_new_tokens: int, monkeypatch):
    """dflash_generate at T=0: (new tokens, acceptance lengths of the steps that verified a full block)."""
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # the reference synchronizes CUDA here
    out = ref.dflash_generate(model, target, torch.tensor([prompt]), max_new_tokens, None, temperature=0.0,
                              return_stats=True)
    full, start, end = [], len(prompt), len(prompt) + max_new_tokens
    for produced in out.acceptance_lengths:
        if end - start <= model.block_size:  # near the end: shorter blocks, counts capped by the budget
            break
        full.append(produced)
        start += produced
    return out.output_ids[0, len(prompt):].tolist(), full
