"""Other systems on the same prompts, in the same process and run: transformers `generate`
(autoregressive, and assisted generation with prompt lookup), llama.cpp through llama-cpp-python on
the same GGUF, and mlx-lm. Each is optional: a peer that is not installed (or has no model to run)
is skipped with a note saying how to get it."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PEERS = ("transformers", "transformers-lookup", "llama.cpp", "mlx-lm", "mlx-lm-speculative")


@dataclass
class PeerRow:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    note: str = ""
    skipped: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self, spec_tokens_per_s: float) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s,
                 ratio_to_spec=self.tokens_per_s / spec_tokens_per_s if spec_tokens_per_s and not self.skipped else None)
        return d


def peer_names(asked: str | None) -> list[str]:
    if not asked:
        return []
    names = list(PEERS) if asked == "all" else [n.strip() for n in asked.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        from .errors import ConfigError
        raise ConfigError(f"unknown peer(s) {', '.join(unknown)}", f"use some of {', '.join(PEERS)}, or all")
    return names


def run_peers(names: list[str], runtime, prompt_ids: list[list[int]], max_new_tokens: int, tick=None,
              draft: str | None = None) -> list[PeerRow]:
    """Greedy decoding of each prompt (token ids from our runtime's encoder, so every system sees the
    same input), up to max_new_tokens or EOS. tick(name) after every prompt; draft: the small
    autoregressive model for mlx-lm's speculative mode."""
    folder = Path(runtime.info["target"])
    rows = []
    for name in names:
        done = (lambda n=name: tick(n)) if tick else (lambda: None)
        if name in ("transformers", "transformers-lookup"):
            rows.append(hf_generate(folder, prompt_ids, max_new_tokens, name == "transformers-lookup", done))
        elif name == "llama.cpp":
            rows.append(llama_cpp(runtime, prompt_ids, max_new_tokens, done))
        else:
            rows.append(mlx_lm(folder, prompt_ids, max_new_tokens, done,
                               draft if name == "mlx-lm-speculative" else None, name))
    return rows


def hf_generate(folder: Path, prompt_ids, max_new_tokens: int, lookup: bool, done) -> PeerRow:
    from transformers import AutoModelForCausalLM

    name = "transformers-lookup" if lookup else "transformers"
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
    row = PeerRow(name, note="HF generate, float32, greedy" + (", prompt lookup (10 tokens)" if lookup else ""))
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_ids[0]]), max_new_tokens=4, do_sample=False, **extra)  # warm-up
        for ids in prompt_ids:
            began = time.perf_counter()
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **extra)
            row.seconds += time.perf_counter() - began
            row.tokens += out.shape[1] - len(ids)
            done()
    return row


def llama_cpp(runtime, prompt_ids, max_new_tokens: int, done) -> PeerRow:
    try:
        from llama_cpp import Llama
    except ImportError:
        return PeerRow("llama.cpp", skipped=True,
                       note="not installed: pip install llama-cpp-python (builds llama.cpp, ~5 min)")
    gguf = runtime.info.get("gguf")
    if not gguf:
        return PeerRow("llama.cpp", skipped=True, note="no GGUF for this target (the default target has one)")
    threads = torch.get_num_threads()
    llm = Llama(model_path=gguf, n_threads=threads, n_ctx=4096, verbose=False)
    row = PeerRow("llama.cpp", note=f"llama-cpp-python, same GGUF ({Path(gguf).name}), {threads} threads, greedy")
    llm.create_completion(prompt_ids[0], max_tokens=4, temperature=0.0)  # warm-up
    for ids in prompt_ids:
        began = time.perf_counter()
        out = llm.create_completion(ids, max_tokens=max_new_tokens, temperature=0.0)
        row.seconds += time.perf_counter() - began
        row.tokens += out["usage"]["completion_tokens"]
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
    row = PeerRow(name, note=note)
    for _ in stream_generate(model, tokenizer, prompt=prompt_ids[0], max_tokens=4, **extra):  # warm-up
        pass
    for ids in prompt_ids:
        began, last = time.perf_counter(), None
        for last in stream_generate(model, tokenizer, prompt=ids, max_tokens=max_new_tokens, **extra):
            pass
        row.seconds += time.perf_counter() - began
        row.tokens += last.generation_tokens if last is not None else 0
        done()
    return row
