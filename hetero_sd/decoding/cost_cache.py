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
import math
import os
from pathlib import Path

import torch

from .costs import Costs, cpu_name, measure_costs
from hetero_sd.home import home

FORMAT = 2  # 2: sizes 3, 6, 12, 24 measured too, every call timed in interleaved rounds
# Verify costs are not linear in k between 2 and 4: on the 2-core Zen 5 a verify of 3 took ~3.2 ms in the loop
# where a line through 2 and 4 said 3.6, so a controller that interpolated took blocks of 3 less often than they paid.
BLOCKS = (2, 3, 4, 6, 8, 12, 16, 24, 32)


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
        for path in sorted(folder.glob("*.py")) + sorted(folder.rglob("*.cpp")):  # kernels/*.cpp too
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cost_key(target_id: str, draft_id: str, target_device: str, draft_device: str, dtype: str,
             block_size: int, code: str = "", policy=None) -> dict:
    """policy: the load policy (backends/policy.py), whose choices (the draft's layer blocks, the kernels) change
    what a step costs under the same models and code."""
    chosen = {k: v for k, v in vars(policy).items() if k != "origin"} if policy is not None else {}
    return {"format": FORMAT, "target": target_id, "draft": draft_id, "target_device": target_device,
            "draft_device": draft_device, "dtype": dtype, "block_size": block_size,
            "threads": torch.get_num_threads(), "cpu": cpu_name(), "torch": torch.__version__, "code": code,
            "policy": ",".join(f"{k}={v}" for k, v in sorted(chosen.items()))}


def cost_path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return home() / "costs" / f"{digest}.json"


def cached_costs(key: dict, notes: list[str] | None = None) -> Costs | None:
    """The saved costs for `key`, or None: no file, another key, a file of the wrong shape (announced
    in `notes`, naming the file: it is measured again and replaced), or costs measured while the
    machine was busy that a quiet machine now measures again."""
    path = cost_path(key)
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return ignored(path, f"unreadable ({type(e).__name__})", notes)
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None if isinstance(saved, dict) and "key" in saved else ignored(path, "not a cost file", notes)
    problem = shape_problem(saved.get("costs"))
    if problem:
        return ignored(path, problem, notes)
    if saved.get("busy") and not machine_busy():
        if notes is not None:
            notes.append(f"cached step costs in {path} were measured on a busy machine ({saved['busy']}); "
                         "measuring them again now that it is quiet")
        return None
    try:
        return Costs.from_json(saved["costs"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return ignored(path, f"a field of the wrong shape ({type(e).__name__}: {e})", notes)


def ignored(path: Path, why: str, notes: list[str] | None) -> None:
    if notes is not None:
        notes.append(f"ignored the cached step costs in {path}: {why}; measuring them again")
    return None


def shape_problem(costs) -> str | None:
    """What is wrong with a saved `costs` object, or None: every time a finite number > 0."""
    if not isinstance(costs, dict):
        return f"'costs' is {type(costs).__name__}, not an object"
    times = {"decode_s": costs.get("decode_s")}
    for table in ("verify_s", "draft_s"):
        entries = costs.get(table)
        if not isinstance(entries, dict) or not entries:
            return f"'{table}' is missing or empty"
        bad_keys = [k for k in entries if not str(k).isdigit()]
        if bad_keys:
            return f"'{table}' has a key that is not a size: {bad_keys[0]!r}"
        times |= {f"{table}[{k}]": v for k, v in entries.items()}
    for name, v in times.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            return f"{name} is {v!r}, not a time > 0"
    return None


def machine_busy() -> str | None:
    """Why the CPU is too busy for costs worth keeping (other processes' runnable threads: the 1-minute
    load average above 1.5x the cores + 1), or None. Costs measured then are used and cached marked as
    such; the next load on a quiet machine measures again (they were 70x a quiet step once)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cores = os.cpu_count() or 1
    return f"load average {load:.1f} on {cores} cores" if load > 1.5 * cores + 1 else None


def costs_for(target, draft, key: dict, notes: list[str]) -> Costs:
    """The cached costs for `key`, or a measurement now (a few seconds, once), saved for next time."""
    costs = cached_costs(key, notes)
    if costs is not None:
        return costs
    context = max(min(512, target.max_context // 2), 1)
    blocks = tuple(b for b in BLOCKS if b < draft.block_size) + (draft.block_size,)
    costs = measure_costs(target, draft, context=context, ks=blocks, blocks=blocks, repeats=3)
    busy = machine_busy()
    path = cost_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "costs": costs.to_json(), "busy": busy}, indent=1))
        os.replace(tmp, path)
        notes.append(f"step costs measured once for this placement ({path})"
                     + (f"; the machine was busy ({busy}): measured again when it is quiet" if busy else ""))
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
