"""Self-distillation data at scale: the target's greedy answers to the training mix (corpus.py), made
by the batched generator (batched.py) and stored in compressed shards that can be committed.

A shard (`shard-NNNNN.npz`) holds, per answer: the prompt's key, its length and a CRC of its token ids
(the prompt text itself is never stored: see corpus.py), the answer's token ids, and whether it ended
with a stop token. `manifest.json` pins what the answers depend on (target, template, length limit);
a run that would mix in answers made differently is refused. Generation resumes from the shards:
prompts whose key is stored are skipped. Answers in flight when the job is stopped are lost (at most a
batch); a SIGTERM or Ctrl-C writes what has finished first. SIGSTOP/SIGCONT only pause it.

Top-k logits are not stored: the trainer runs the target over every sequence anyway (for its hidden
states), so the target's logits for soft labels come from that same forward, at no storage cost."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from hetero_sd.errors import ConfigError
from .batched import Answer, BatchedGenerator
from .corpus import TrainPrompt, sharegpt_prompts, stdlib_prompts, training_mix

FORMAT = 1


def prompt_crc(ids: list[int]) -> int:
    return zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes())


def chat_ids(tokenizer, text: str) -> list[int]:
    """As Runtime.encode puts a text prompt to a chat model (answers to plain text would teach the draft
    another distribution than the one it serves, so a target without a chat template is refused)."""
    if not tokenizer.chat_template:
        raise ConfigError("self-distillation needs a chat model: the target's tokenizer has no chat template",
                          "use an instruction-tuned target, or give its tokenizer a chat_template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def open_manifest(folder: Path, manifest: dict, holds: str, fix: str) -> Path:
    """Create `folder` and its manifest.json, or check that the stored manifest asks what `manifest` asks
    (a store resumed with other settings would mix two kinds of data). Written atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "manifest.json"
    if path.is_file():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in manifest.items() if old.get(k) != v}
        if diff:
            raise ConfigError(f"{folder} holds {holds} made differently: {diff} (stored, asked)", fix)
    else:
        tmp = folder / f".manifest.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, path)
    return folder


class ShardStore:
    def __init__(self, folder: Path, manifest: dict):
        self.folder = open_manifest(folder, manifest, "answers", "use the stored settings (the int8 target's K cache: "
                                    "HETERO_SD_KV=float16 where the store says no q8_0 K) or another folder")
        self.manifest = manifest

    @classmethod
    def existing(cls, folder: Path) -> "ShardStore":
        path = Path(folder) / "manifest.json"
        if not path.is_file():
            raise ConfigError(f"{folder} holds no self-distillation shards (no manifest.json)",
                              "make them with: hetero-sd train-draft --distill DIR --generate-only")
        return cls(folder, json.loads(path.read_text()))

    def shards(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.npz"))

    def read(self) -> Iterator[dict]:
        for path in self.shards():
            with np.load(path) as z:
                keys, offsets, tokens = z["keys"], z["offsets"], z["tokens"]
                for i, key in enumerate(keys):
                    yield {"key": str(key), "prompt_len": int(z["prompt_len"][i]),
                           "prompt_crc": int(z["prompt_crc"][i]), "finished": bool(z["finished"][i]),
                           "response_ids": tokens[offsets[i]:offsets[i + 1]].astype(np.int64).tolist()}

    def done_keys(self) -> set[str]:
        done = set()
        for path in self.shards():
            with np.load(path) as z:
                done.update(str(k) for k in z["keys"])
        return done

    def append(self, answers: list[Answer]) -> Path | None:
        """One new shard, written to a temporary name and renamed: a crash never leaves half a shard."""
        if not answers:
            return None
        n = 1 + max([int(p.stem.split("-")[1]) for p in self.shards()] or [-1])
        dtype = np.uint16 if self.manifest["vocab_size"] <= 1 << 16 else np.uint32
        lengths = [len(a.response_ids) for a in answers]
        arrays = {"keys": np.array([a.key for a in answers]),
                  "prompt_len": np.array([len(a.prompt_ids) for a in answers], dtype=np.int32),
                  "prompt_crc": np.array([prompt_crc(a.prompt_ids) for a in answers], dtype=np.uint32),
                  "finished": np.array([a.finished for a in answers], dtype=bool),
                  "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                  "tokens": np.array([t for a in answers for t in a.response_ids], dtype=dtype)}
        path = self.folder / f"shard-{n:05d}.npz"
        tmp = self.folder / f".tmp-{path.name}"
        with tmp.open("wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
        return path


def manifest_for(target_folder: Path, tokenizer, vocab_size: int, stop_ids, *, max_new_tokens: int,
                 max_prompt_tokens: int, seed: int, turns: str, dtype: str = "float32") -> dict:
    template = tokenizer.chat_template or ""
    return {"format": FORMAT, "target": Path(target_folder).name, "vocab_size": vocab_size,
            "chat_template_sha1": hashlib.sha1(template.encode()).hexdigest(), "stop_ids": sorted(stop_ids),
            "decoding": f"greedy, {dtype}", "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens, "mix_seed": seed, "sharegpt_turns": turns}


def windows(prompts: list[TrainPrompt], tokenizer, size: int, max_tokens: int, counts: dict) -> Iterator[tuple[str, list[int]]]:
    """Prompts in mix order, encoded lazily; within each window of `size`, shortest first (slots that
    refill together then pad little). Prompts over max_tokens are counted and left out."""
    for start in range(0, len(prompts), size):
        encoded = [(p.key, chat_ids(tokenizer, p.text)) for p in prompts[start:start + size]]
        fit = [e for e in encoded if len(e[1]) <= max_tokens]
        counts["too_long"] += len(encoded) - len(fit)
        yield from sorted(fit, key=lambda e: len(e[1]))


def generate_shards(target_folder: Path, out: Path, *, max_new_tokens: int = 256, max_prompt_tokens: int = 384,
                    slots: int = 32, seed: int = 0, turns: str = "first", limit: int | None = None,
                    flush_rows: int = 512, flush_seconds: float = 900.0, progress: Path | None = None,
                    prompts: list[TrainPrompt] | None = None, dtype: str = "float32", k_q8: bool = True,
                    log=print) -> dict:
    """Answer the prompts (default: the training mix) not yet in `out`; returns the final progress record.
    dtype "bfloat16" is ~2x faster here (AMX) but its greedy answers leave float32's at near-ties
    (measured on the shipped draft's prompts): labels of a slightly different model. "int8": the answers of the
    default CPU target of a GGUF (int8 rows x its blocks), on that target's kernels, with its K cache as q8_0
    blocks where the CPU has AVX512-VNNI (k_q8=False: float16); the manifest names the q8_0 K, so that a store
    is never extended with the other cache's answers."""
    from transformers import AutoTokenizer

    from hetero_sd.models.config import ArchConfig, read_json
    from hetero_sd.loading.loader import stop_ids as runtime_stop_ids

    tokenizer = AutoTokenizer.from_pretrained(str(target_folder))
    cfg = ArchConfig.from_dict(read_json(target_folder / "config.json"))
    stops = runtime_stop_ids(cfg, tokenizer, target_folder)
    torch_dtype, numerics = torch.float32 if dtype == "int8" else getattr(torch, dtype), "int8" if dtype == "int8" else "float32"
    # the store is checked against the answers' kind (its K cache included) before the target loads
    answers_k_q8 = BatchedGenerator.answers_k_q8(BatchedGenerator.plan(target_folder, cfg, torch_dtype, numerics, k_q8=k_q8), numerics)
    manifest = manifest_for(target_folder, tokenizer, cfg.vocab_size, stops, seed=seed, turns=turns,
                            dtype=dtype + ", q8_0 K" * answers_k_q8, max_new_tokens=max_new_tokens,
                            max_prompt_tokens=max_prompt_tokens)
    store = ShardStore(out, manifest)
    gen = BatchedGenerator(target_folder, slots=slots, max_new_tokens=max_new_tokens,
                           max_prompt_tokens=max_prompt_tokens, stop_ids=stops, dtype=torch_dtype, numerics=numerics,
                           k_q8=k_q8)
    info: dict = {"given": len(prompts)} if prompts is not None else {}
    if prompts is None:
        prompts, info = training_mix(seed, turns=turns)
    prompts = prompts[:limit] if limit else prompts
    done = store.done_keys()
    todo = [p for p in prompts if p.key not in done]
    log(f"mix: {info}; {len(done)} answered before, {len(todo)} to answer")
    counts = {"too_long": 0}
    meter = Meter(len(prompts), len(done), progress, counts)
    stop_on_term()
    buffer: list[Answer] = []
    last_flush = time.monotonic()
    try:
        for answer in gen.generate(windows(todo, tokenizer, slots * 8, max_prompt_tokens, counts)):
            buffer.append(answer)
            meter.add(answer)
            if len(buffer) >= flush_rows or time.monotonic() - last_flush > flush_seconds:
                shard = store.append(buffer)
                buffer, last_flush = [], time.monotonic()
                meter.write(shards=len(store.shards()))
                log(f"{shard.name}: {json.dumps(meter.record)}")
    finally:
        store.append(buffer)
        meter.write(shards=len(store.shards()), final=True)
    return meter.record


def unanswered(prompts: list[TrainPrompt], stores: Iterable[Path]) -> list[TrainPrompt]:
    """The prompts no store in `stores` has answered (`--skip-answered`: a new store answers only new prompts,
    e.g. the int8 target's answers to every ShareGPT turn beside the float32 answers to the openings)."""
    done: set[str] = set()
    for folder in stores:
        done |= ShardStore.existing(Path(folder)).done_keys()
    return [p for p in prompts if p.key not in done]


def stop_on_term() -> None:
    """SIGTERM ends the job like Ctrl-C, so that the finally-block writes the finished answers."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


class Meter:
    """Progress of this run, written as JSON: answers, tokens, tokens/s over wall time and CPU time
    (wall time includes any SIGSTOP pause; CPU time does not)."""

    def __init__(self, total: int, before: int, path: Path | None, counts: dict):
        self.total, self.before, self.path, self.counts = total, before, path, counts
        self.answers = self.tokens = self.finished = 0
        self.wall, self.cpu = time.monotonic(), time.process_time()
        self.record: dict = {}
        self.last_write = 0.0

    def add(self, answer: Answer) -> None:
        self.answers += 1
        self.tokens += len(answer.response_ids)
        self.finished += answer.finished
        if time.monotonic() - self.last_write > 60:
            self.write()

    def write(self, shards: int | None = None, final: bool = False) -> None:
        wall, cpu = time.monotonic() - self.wall, time.process_time() - self.cpu
        self.record = {"pid": os.getpid(), "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "prompts_in_mix": self.total, "answered_before": self.before,
                       "answered_this_run": self.answers, "tokens_this_run": self.tokens,
                       "ended_with_stop_token": self.finished, "skipped_too_long": self.counts["too_long"],
                       "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                       "tokens_per_wall_s": round(self.tokens / max(wall, 1e-9), 1), "final": final}
        if shards is not None:
            self.record["shards"] = shards
        self.last_write = time.monotonic()
        if self.path:
            tmp = Path(str(self.path) + ".tmp")
            tmp.write_text(json.dumps(self.record, indent=2) + "\n")
            os.replace(tmp, self.path)


def prompt_texts(keys: Iterable[str]) -> dict[str, str]:
    """The texts of stored keys, read again from their sources."""
    keys = set(keys)
    texts = {}
    if any(k.startswith("sharegpt:") for k in keys):
        texts.update((p.key, p.text) for p in sharegpt_prompts(turns="all") if p.key in keys)
    if any(k.startswith("stdlib:") for k in keys):
        texts.update((p.key, p.text) for p in stdlib_prompts() if p.key in keys)
    return texts


def load_distilled(folder: Path, target_folder: Path, texts: dict[str, str] | None = None, log=print) -> list[dict]:
    """Training rows {index, source, key, prompt_ids, response_ids} from shards. A prompt whose text
    reads differently now (another Python's stdlib, another package version) fails its CRC and is left
    out, and the count is reported."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_folder))
    stored = list(ShardStore.existing(folder).read())
    texts = prompt_texts(r["key"] for r in stored) if texts is None else texts
    rows, missing, changed = [], 0, 0
    for r in stored:
        if r["key"] not in texts:
            missing += 1
            continue
        ids = chat_ids(tokenizer, texts[r["key"]])
        if len(ids) != r["prompt_len"] or prompt_crc(ids) != r["prompt_crc"]:
            changed += 1
            continue
        rows.append({"index": len(rows), "key": r["key"], "source": r["key"].split(":", 1)[0],
                     "prompt_ids": ids, "response_ids": r["response_ids"]})
    if missing or changed:
        log(f"{folder}: {missing} answers whose prompt is gone and {changed} whose prompt reads differently "
            f"were left out ({len(rows)} kept)")
    return rows


def load_stores(folders: list[Path], target_folder: Path, log=print) -> list[dict]:
    """The rows of several stores, numbered on (`index`); with more than one store each row carries its
    store's number (`store`), so that each store keeps its own held-out rows (trainer.split_held_out)."""
    rows: list[dict] = []
    for i, folder in enumerate(folders):
        part = load_distilled(folder, target_folder, log=log)
        rows += [dict(r, index=len(rows) + j, **({"store": i} if len(folders) > 1 else {})) for j, r in enumerate(part)]
    return rows
