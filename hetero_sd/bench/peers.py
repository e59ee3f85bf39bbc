"""Other systems on the same prompts and token ids, in the same run: transformers `generate`
(autoregressive, and assisted generation with prompt lookup), llama.cpp (autoregressive, and its own
DFlash on our draft converted to GGUF; binaries from benchmarks/build_llama_cpp.sh), z-lab's reference
DFlash loop on our draft, and mlx-lm. Each is optional: a peer that is not installed (or has no model
to run) is skipped with a note saying how to get it. Every answer gets the loop rule of repetition.py."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .peer_row import PeerRow, placement, synced

PEERS = ("transformers", "transformers-lookup", "llama.cpp", "llama.cpp-dflash", "zlab-reference", "mlx-lm",
         "mlx-lm-speculative")


def peer_names(asked: str | None) -> list[str]:
    if not asked:
        return []
    names = list(PEERS) if asked == "all" else [n.strip() for n in asked.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        from hetero_sd.errors import ConfigError
        raise ConfigError(f"unknown peer(s) {', '.join(unknown)}", f"use some of {', '.join(PEERS)}, or all")
    return names


def run_peers(names: list[str], runtime, prompt_ids: list[list[int]], max_new_tokens: int, tick=None,
              draft: str | None = None, ours: list[dict] | None = None) -> list[PeerRow]:
    """Greedy decoding of each prompt (token ids from our runtime's encoder, so every system sees the
    same input), up to max_new_tokens or EOS. tick(name) after every prompt; draft: the small
    autoregressive model for mlx-lm's speculative mode; ours: this run's bench rows (output_ids, tau),
    which z-lab's reference is checked against."""
    folder = Path(runtime.info["target"])
    rows = []
    for name in names:
        done = (lambda n=name: tick(n)) if tick else (lambda: None)
        try:
            rows.append(one_peer(name, folder, runtime, prompt_ids, max_new_tokens, done, draft, ours or []))
        except KeyboardInterrupt as e:  # a stopped bench keeps the peers that finished (PeersStopped.rows)
            rows += [PeerRow(n, skipped=True, note="not run: the bench was stopped") for n in names[len(rows):]]
            raise PeersStopped(rows) from e
        except Exception as e:  # a broken peer must not lose the run: recorded as skipped, with why
            rows.append(PeerRow(name, skipped=True, note=f"failed: {type(e).__name__}: {str(e)[:500]}"))
    compare_llama_cpp(rows)
    return rows


class PeersStopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while the peers ran: the rows of those that finished, the others skipped."""

    def __init__(self, rows: list[PeerRow]):
        super().__init__()
        self.rows = rows


def compare_llama_cpp(rows: list[PeerRow]) -> None:
    """llama.cpp's DFlash against its own autoregressive decoding of the same GGUF: greedy speculative
    decoding should give the same answer; where it does not, its verify batches and its single-token
    steps do not compute the same logits (quantised kernels can differ by batch size). Per prompt: the first differing token of the two answers (their texts encoded
    with the target's tokenizer; None: identical)."""
    by_name = {r.name: r for r in rows if not r.skipped}
    dflash, plain = by_name.get("llama.cpp-dflash"), by_name.get("llama.cpp")
    if not (dflash and plain):
        return
    from .runner import first_divergence

    for a, b in zip(dflash.prompts, plain.prompts):
        a["first_divergence_from_llama.cpp"] = first_divergence(b["output_ids"], a["output_ids"])
    same = sum(p["first_divergence_from_llama.cpp"] is None for p in dflash.prompts)
    dflash.note += f"; its answers equal llama.cpp's autoregressive ones on {same} of {len(dflash.prompts)} prompts"


def one_peer(name, folder: Path, runtime, prompt_ids, max_new_tokens: int, done, draft, ours) -> PeerRow:
    from .peers_llama import llama_cpp_peer
    from .peers_zlab import zlab_reference

    if name in ("transformers", "transformers-lookup"):
        return hf_generate(folder, prompt_ids, max_new_tokens, name == "transformers-lookup", done, *placement(runtime))
    if name in ("llama.cpp", "llama.cpp-dflash"):
        return llama_cpp_peer(runtime, prompt_ids, max_new_tokens, done, name)
    if name == "zlab-reference":
        return zlab_reference(runtime, prompt_ids, max_new_tokens, done, ours)
    return mlx_lm(folder, prompt_ids, max_new_tokens, done, draft if name == "mlx-lm-speculative" else None, name)


def hf_generate(folder: Path, prompt_ids, max_new_tokens: int, lookup: bool, done, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> PeerRow:
    from transformers import AutoModelForCausalLM

    name = "transformers-lookup" if lookup else "transformers"
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
    row = PeerRow(name, note="HF generate, greedy" + (", prompt lookup (10 tokens)" if lookup else ""),
                  weights=f"{str(dtype).removeprefix('torch.')} on {device}, our HF target folder ({folder.name})")
    with torch.inference_mode():
        synced(device, lambda: model.generate(torch.tensor([prompt_ids[0]], device=device), max_new_tokens=4,
                                              do_sample=False, **extra))  # warm-up
        for ids in prompt_ids:
            began = time.perf_counter()
            out = synced(device, lambda: model.generate(torch.tensor([ids], device=device),
                                                        max_new_tokens=max_new_tokens, do_sample=False, **extra))
            row.add(out[0, len(ids):].tolist(), time.perf_counter() - began)
            done()
    return row


def mlx_lm(folder: Path, prompt_ids, max_new_tokens: int, done, draft: str | None, name: str) -> PeerRow:
    """mlx-lm greedy; with a draft, its speculative mode (a small autoregressive model with the same
    tokenizer: mlx-lm has no DFlash drafts)."""
    try:
        from mlx_lm import load, stream_generate
    except ImportError:
        return PeerRow(name, skipped=True, note="not installed: pip install mlx-lm")
    extra, note = {}, "mlx-lm stream_generate, greedy (on Linux: MLX's CPU build)"
    if name == "mlx-lm-speculative":
        if not draft:
            return PeerRow(name, skipped=True, note="needs --peer-draft: a smaller autoregressive model with the "
                                                    "target's tokenizer (none ships for the default target)")
        extra = {"draft_model": load(draft)[0], "num_draft_tokens": 4}
        note += f", speculative with draft {Path(draft).name} (4 tokens)"
    model, tokenizer = load(str(folder))
    row = PeerRow(name, note=note, weights=f"MLX load of our HF target folder ({folder.name})")
    for _ in stream_generate(model, tokenizer, prompt=prompt_ids[0], max_tokens=4, **extra):  # warm-up
        pass
    for ids in prompt_ids:
        began, out = time.perf_counter(), []
        for r in stream_generate(model, tokenizer, prompt=ids, max_tokens=max_new_tokens, **extra):
            out.append(int(r.token))
        row.add(out, time.perf_counter() - began)
        done()
    return row
