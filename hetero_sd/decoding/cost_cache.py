"""Step costs per machine and placement, measured once and reused (the controller's cost model).

A cost file is keyed by everything that changes what a step costs: the target and the draft (their
folders and configs), the devices, the dtype, torch's thread count, the CPU, the torch version and the
backends' own code (a faster kernel must not inherit the old costs). Any
change gives another key, hence a fresh measurement; a file whose recorded key differs (a hash
collision, an older format) is measured again and replaced."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path

import torch

from .costs import Costs, cpu_name, measure_costs
from hetero_sd.home import home

FORMAT = 1
BLOCKS = (2, 4, 8, 16, 32)


def source_id(folder: Path | str | None, spec: str) -> str:
    """A model's identity for the key: its folder and a hash of its config.json (or the spec itself)."""
    if folder is None:
        return spec
    config = Path(folder) / "config.json"
    digest = hashlib.sha1(config.read_bytes()).hexdigest()[:12] if config.is_file() else "no-config"
    return f"{Path(folder).resolve()}#{digest}"


def code_id(*backends) -> str:
    """A hash of the source files of the packages the backends come from."""
    digest = hashlib.sha1()
    for folder in sorted({Path(inspect.getfile(type(b))).parent for b in backends}):
        for path in sorted(folder.glob("*.py")) + sorted(folder.glob("*.cpp")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cost_key(target_id: str, draft_id: str, target_device: str, draft_device: str, dtype: str,
             block_size: int, code: str = "") -> dict:
    return {"format": FORMAT, "target": target_id, "draft": draft_id, "target_device": target_device,
            "draft_device": draft_device, "dtype": dtype, "block_size": block_size,
            "threads": torch.get_num_threads(), "cpu": cpu_name(), "torch": torch.__version__, "code": code}


def cost_path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return home() / "costs" / f"{digest}.json"


def cached_costs(key: dict) -> Costs | None:
    path = cost_path(key)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return Costs.from_json(saved["costs"]) if saved.get("key") == key else None


def costs_for(target, draft, key: dict, notes: list[str]) -> Costs:
    """The cached costs for `key`, or a measurement now (a few seconds, once), saved for next time."""
    costs = cached_costs(key)
    if costs is not None:
        return costs
    context = max(min(512, target.max_context // 2), 1)
    blocks = tuple(b for b in BLOCKS if b < draft.block_size) + (draft.block_size,)
    costs = measure_costs(target, draft, context=context, ks=blocks, blocks=blocks, repeats=3)
    path = cost_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "costs": costs.to_json()}, indent=1))
        os.replace(tmp, path)
        notes.append(f"step costs measured once for this placement ({path})")
    except OSError as e:  # a read-only home: the costs still apply to this runtime
        notes.append(f"step costs measured but not cached ({e}); they will be measured again next time")
    return costs


def forget(key: dict, plain_factor: float) -> str:
    """Drop cached costs that this machine's plain steps keep contradicting (measured while something
    else ran, or the machine changed under the same key); the next load measures them again."""
    path = cost_path(key)
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        return f"cached step costs are off (plain steps take {plain_factor:.2f}x) but could not be dropped: {e}"
    return (f"cached step costs were off for this machine now (plain steps took {plain_factor:.2f}x the cached "
            f"decode step; measured under load?): corrected for this run, measured again at the next load")
