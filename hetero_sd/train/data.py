"""Self-distillation data: the target answers the training prompts itself (greedy), in batches with
transformers' `generate`. Rows are appended to a JSONL file as they finish, so an interrupted run
resumes where it stopped."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def done_indices(path: Path) -> set[int]:
    if not path.is_file():
        return set()
    return {json.loads(line)["index"] for line in path.read_text().splitlines() if line.strip()}


def generate_responses(target_folder: Path, prompts: list[dict], out: Path, *, max_new_tokens: int = 256,
                       batch_size: int = 32, progress=None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_folder))
    model = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    done = done_indices(out)
    todo = [(i, p) for i, p in enumerate(prompts) if i not in done]
    encoded = [(i, p, chat_ids(tokenizer, p["prompt"])) for i, p in todo]
    encoded.sort(key=lambda row: len(row[2]))  # similar lengths per batch: less padding
    with out.open("a") as f:
        for b in range(0, len(encoded), batch_size):
            batch = encoded[b:b + batch_size]
            for row in generate_batch(model, batch, pad, eos, max_new_tokens):
                f.write(json.dumps(row) + "\n")
            f.flush()
            if progress:
                progress(min(b + batch_size, len(encoded)), len(encoded))
    return out


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.inference_mode()
def generate_batch(model, batch, pad: int, eos: int, max_new_tokens: int) -> list[dict]:
    width = max(len(ids) for _, _, ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, _, ids in batch])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, _, ids in batch])
    out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad, eos_token_id=eos)
    rows = []
    for (index, prompt, ids), seq in zip(batch, out[:, width:].tolist()):
        response = seq[:seq.index(eos) + 1] if eos in seq else seq
        rows.append({"index": index, "source": prompt["source"], "prompt_ids": ids, "response_ids": response})
    return rows


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
