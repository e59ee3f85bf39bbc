"""Published target -> DFlash draft pairs, for `--draft auto`.

From z-lab's model list (github.com/z-lab/dflash README, "Supported Models"; each draft's model card
names the target it must be paired with). None of these was downloaded here: the names resolve through
huggingface-hub's cache like any hub id (sources.py), downloaded on first use or read from the cache
under HF_HUB_OFFLINE=1. A target matches by its hub id, or by the model name its local folder, hub-cache
snapshot or GGUF file carries (e.g. Qwen3-8B-Q4_K_M.gguf -> Qwen3-8B)."""

from __future__ import annotations

import re
from pathlib import Path

from hetero_sd.errors import ConfigError

PAIRS = {
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",  # trained on non-thinking answers
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",  # trained on non-thinking answers
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "Qwen/Qwen3-Coder-Next": "z-lab/Qwen3-Coder-Next-DFlash",
    "openai/gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
    "openai/gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash",
    "Qwen/Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash",
    "Qwen/Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen/Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash",
    "Qwen/Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "Qwen/Qwen3.5-122B-A10B": "z-lab/Qwen3.5-122B-A10B-DFlash",
    "Qwen/Qwen3.6-27B": "z-lab/Qwen3.6-27B-DFlash",
    "Qwen/Qwen3.6-35B-A3B": "z-lab/Qwen3.6-35B-A3B-DFlash",
    "google/gemma-4-26B-A4B-it": "z-lab/gemma-4-26B-A4B-it-DFlash",
    "google/gemma-4-31B-it": "z-lab/gemma-4-31B-it-DFlash",
    "moonshotai/Kimi-K2.5": "z-lab/Kimi-K2.5-DFlash",
}
BY_NAME = {repo.split("/", 1)[1].lower(): draft for repo, draft in PAIRS.items()}
# A GGUF file's quantization suffix (Qwen3-8B-Q4_K_M, gpt-oss-20b.Q8_0, ...-UD-IQ2_XXS, -BF16).
QUANT_SUFFIX = re.compile(r"([-.](ud-)?(i?q\d[\w]*|f16|bf16|f32|mxfp4)([-.].*)?)$", re.IGNORECASE)
HUB_CACHE_DIR = re.compile(r"models--([^/]+)--([^/]+)")


def model_name(target: str) -> str:
    """The model name a target spec carries: org/name -> name; a hub-cache snapshot path -> its repo's
    name; a folder -> its name; a .gguf file -> its stem without the quantization suffix."""
    cached = HUB_CACHE_DIR.search(str(target))
    if cached:
        return cached.group(2)
    path = Path(target)
    if path.suffix == ".gguf":
        return QUANT_SUFFIX.sub("", path.stem)
    return path.name


def published_draft(target: str) -> str | None:
    if target in PAIRS:
        return PAIRS[target]
    return BY_NAME.get(model_name(target).lower())


def auto_draft(target: str) -> str:
    draft = published_draft(target)
    if draft is None:
        raise ConfigError(f"no published DFlash draft is known for target {target!r} (--draft auto knows "
                          f"{len(PAIRS)} targets: {', '.join(PAIRS)})",
                          "pass --draft FOLDER or org/name, 'random' to try the machinery, or 'none'")
    return draft
