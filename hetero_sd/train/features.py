"""Target features on disk: computed once per training sequence, read back at every later epoch.

The target's forward over a sequence (its hidden states at the draft's feature layers) costs as much CPU as
training ~all of that sequence's blocks; kept in memory only (train/trainer.py's FeatureCache) it is paid
again whenever a sequence comes back after leaving the bounded cache, i.e. almost every time with data at
scale. Here it is paid once.

Layout of a store (outside git: under the model home or --feature-cache DIR; ~5.8 KB per token for
SmolLM2-135M, 5 layers x 576 x bf16):
- `manifest.json`: what the features depend on: the target (name + SHA-1 of its config.json), the feature
  layer ids, dtype, width. A store made for another target or other layers is refused by name.
- shards `feat-<writer>-<n>.npy` (bf16 stored as uint16, [tokens, width]) each with its index
  `feat-<writer>-<n>.json`: per sequence its key, CRC of its token ids, offset and length. The index is
  written after the array and both are renamed into place, so a killed writer leaves no half shard; writer
  ids differ per process, so a background fill and a training run can add to one store at once.
- `progress.json`: the fill command's progress (sequences, tokens, CPU seconds, rate).
A sequence is found by its key and the CRC of its tokens: data that changed is computed afresh."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import torch

from hetero_sd.errors import ConfigError

from .distill import open_manifest

FORMAT = 1


def token_crc(ids) -> int:
    return zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes())


def store_manifest(target_folder: Path, layer_ids: list[int], width: int, numerics: str = "float32") -> dict:
    """numerics: the target's rows, float32 (the stores so far: no key) or int8 (the runtime's default CPU
    target; "int8, q8_0 K" with its K cache as q8_0 blocks); a store holds one kind."""
    config = (Path(target_folder) / "config.json").read_bytes()
    return {"format": FORMAT, "target": Path(target_folder).name,
            "target_config_sha1": hashlib.sha1(config).hexdigest(),
            "layer_ids": list(layer_ids), "dtype": "bfloat16", "width": width,
            **({"numerics": numerics} if numerics != "float32" else {})}


class FeatureStore:
    """Features [S, width] per sequence key, on disk; `get` returns None for a sequence not stored."""

    def __init__(self, folder: Path, manifest: dict, flush_tokens: int = 1 << 16):
        self.folder = open_manifest(folder, manifest, "features", "give another --feature-cache folder")
        stored = json.loads((self.folder / "manifest.json").read_text()).get("numerics", "float32")
        if stored != manifest.get("numerics", "float32"):  # a float32 manifest names no numerics: check both ways
            raise ConfigError(f"{folder} holds features of the {stored} target, not the "
                              f"{manifest.get('numerics', 'float32')} one asked", "give another --feature-cache folder")
        self.manifest, self.width = manifest, manifest["width"]
        self.index: dict[str, tuple[str, int, int, int]] = {}  # key -> (shard, crc, offset, length)
        self.known: set[str] = set()
        self.arrays: dict[str, np.ndarray] = {}
        self.writer = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # unique per store: two writers never share a name
        self.pending: list[tuple[str, int, np.ndarray]] = []
        self.pending_tokens, self.flush_tokens, self.written = 0, flush_tokens, 0
        self.refresh()

    @classmethod
    def for_target(cls, folder: Path, target_folder: Path, layer_ids: list[int], width: int,
                   numerics: str = "float32") -> "FeatureStore":
        return cls(Path(folder), store_manifest(target_folder, layer_ids, width, numerics))

    def refresh(self) -> None:
        """Read the indexes of shards written since (by this process or another one)."""
        for path in sorted(self.folder.glob("feat-*.json")):
            if path.stem in self.known:
                continue
            for key, crc, offset, length in json.loads(path.read_text())["entries"]:
                self.index[key] = (path.stem, crc, offset, length)
            self.known.add(path.stem)

    def __len__(self) -> int:
        return len(self.index)

    def has(self, key: str, ids) -> bool:
        entry = self.index.get(key)
        return entry is not None and entry[1] == token_crc(ids) and entry[3] == len(ids)

    def get(self, key: str, ids) -> torch.Tensor | None:
        """The stored features (bf16 tensor [S, width]) of this sequence, or None."""
        if not self.has(key, ids):
            for k, crc, arr in self.pending:  # written by this process, not yet flushed
                if k == key and crc == token_crc(ids):
                    return torch.from_numpy(arr).view(torch.bfloat16)
            return None
        shard, _, offset, length = self.index[key]
        if shard not in self.arrays:
            self.arrays[shard] = np.load(self.folder / f"{shard}.npy", mmap_mode="r")
        return torch.from_numpy(np.array(self.arrays[shard][offset:offset + length])).view(torch.bfloat16)

    def put(self, key: str, ids, features: torch.Tensor) -> None:
        if features.shape != (len(ids), self.width):
            raise ValueError(f"features {tuple(features.shape)} for {len(ids)} tokens, width {self.width}")
        arr = features.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy()
        self.pending.append((key, token_crc(ids), arr))
        self.pending_tokens += len(ids)
        if self.pending_tokens >= self.flush_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the pending sequences as one shard (array, then index; each renamed into place)."""
        if not self.pending:
            return
        name = f"feat-{self.writer}-{self.written:05d}"
        entries, offset = [], 0
        for key, crc, arr in self.pending:
            entries.append([key, crc, offset, arr.shape[0]])
            offset += arr.shape[0]
        tmp = self.folder / f".{name}.npy.tmp"
        with tmp.open("wb") as f:
            np.save(f, np.concatenate([a for _, _, a in self.pending]))
        os.replace(tmp, self.folder / f"{name}.npy")
        tmp = self.folder / f".{name}.json.tmp"
        tmp.write_text(json.dumps({"entries": entries}))
        os.replace(tmp, self.folder / f"{name}.json")
        self.written += 1
        self.pending, self.pending_tokens = [], 0
        self.refresh()


def fill(store: FeatureStore, rows: list[dict], compute, progress: Path | None = None, log=print,
         every_s: float = 30.0) -> dict:
    """Compute and store the features of every row not yet stored (resumable: a rerun skips stored ones).
    `compute(ids) -> [S, width]`. Progress goes to `progress` (JSON) every `every_s` seconds and at the end."""
    todo = [r for r in rows if not store.has(r["key"], r["prompt_ids"] + r["response_ids"])]
    record = {"sequences_total": len(rows), "stored_at_start": len(rows) - len(todo), "done": 0, "tokens": 0,
              "cpu_s": 0.0, "wall_s": 0.0, "final": False}
    cpu0, wall0, last = time.process_time(), time.perf_counter(), 0.0

    def write():
        record.update(cpu_s=round(time.process_time() - cpu0, 1), wall_s=round(time.perf_counter() - wall0, 1))
        record["tokens_per_cpu_s"] = round(record["tokens"] / max(record["cpu_s"], 1e-9), 1)
        if progress is not None:
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, progress)

    try:
        for row in todo:
            ids = row["prompt_ids"] + row["response_ids"]
            store.put(row["key"], ids, compute(ids))
            record["done"] += 1
            record["tokens"] += len(ids)
            if time.perf_counter() - last > every_s:
                last = time.perf_counter()
                write()
        record["final"] = True
    finally:
        store.flush()
        write()
        log(f"feature store {store.folder}: {record['done']} sequences computed ({record['tokens']} tokens, "
            f"{record['cpu_s']} CPU s), {len(store)} stored")
    return record
