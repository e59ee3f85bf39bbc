"""Which grammar engine enforces JSON schemas for the constrained decoder (hetero_sd/decoding/constrained.py):
xgrammar, llguidance and outlines-core, measured on the default target's tokenizer (SmolLM2, 49,152 tokens).

Per engine and schema: the compile time, then a valid JSON answer (tokenized by the model's own tokenizer)
walked token by token (one thread), timing the mask of the allowed next tokens at each position (the work a constrained
decode step adds per verified row) and checking exactness: every token of the valid answer is allowed where
it comes, and the end is accepted. Writes benchmarks/results/json_schema_engines.json.

    .venv/bin/python benchmarks/json_schema_bench.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results" / "json_schema_engines.json"

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "email": {"type": "string"}},
                "required": ["name", "age", "email"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "any_object": ({"type": "object"}, {"note": "free-form", "n": [1, 2.5, None, True], "nested": {"k": "v"}}),
    "order": ({"type": "object", "properties": {
                  "id": {"type": "string"}, "items": {"type": "array", "items": {
                      "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                      "required": ["sku", "qty"], "additionalProperties": False}},
                  "status": {"enum": ["open", "paid", "shipped"]}},
               "required": ["id", "items", "status"], "additionalProperties": False},
              {"id": "A-1042", "items": [{"sku": "X1", "qty": 2}, {"sku": "Y77", "qty": 10}], "status": "paid"}),
}


def answer_ids(tokenizer, value) -> list[int]:
    return tokenizer.encode(json.dumps(value), add_special_tokens=False)


def xgrammar_engine(tokenizer, vocab: int, eos: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile_(schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def walk(compiled, ids):
        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        logits = torch.zeros(1, vocab)
        times, exact = [], True
        for t in ids + [eos]:
            began = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            times.append(time.perf_counter() - began)
            exact &= bool((bitmask[0, t // 32] >> (t % 32)) & 1)
            exact &= m.accept_token(t)
            logits.zero_()
        return times, exact and m.is_terminated()
    return compile_, walk


def llguidance_engine(tokenizer, vocab: int, eos: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def compile_(schema):
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})

    def walk(grammar, ids):
        m = llguidance.LLMatcher(lltok, grammar)
        bitmask = lt.allocate_token_bitmask(1, vocab)
        logits = torch.zeros(1, vocab)
        times, exact = [], True
        for t in ids + [eos]:
            began = time.perf_counter()
            lt.fill_next_token_bitmask(m, bitmask, 0)
            lt.apply_token_bitmask_inplace(logits, bitmask)
            times.append(time.perf_counter() - began)
            exact &= bool((bitmask[0, t // 32] >> (t % 32)) & 1)
            exact &= m.consume_token(t)
            logits.zero_()
        return times, exact and m.is_stopped() and not m.get_error()
    return compile_, walk


def outlines_engine(tokenizer, vocab: int, eos: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # outlines-core keys its vocabulary by each token's decoded string (bytes as the tokenizer decodes them)
    tokens: dict[str, list[int]] = {}
    for i in range(len(tokenizer)):
        if i == eos:
            continue
        tokens.setdefault(tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(i)]), []).append(i)
    vocabulary = Vocabulary(eos, tokens)

    def compile_(schema):
        return Index(build_regex_from_schema(json.dumps(schema)), vocabulary)

    def walk(index, ids):
        guide = Guide(index)
        mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        logits = torch.zeros(1, vocab)
        times, exact = [], True
        for t in ids + [eos]:
            began = time.perf_counter()
            allowed = torch.tensor(guide.get_tokens())
            logits[0, allowed] += 1.0  # the cheapest use of the allowed list: one scatter
            times.append(time.perf_counter() - began)
            exact &= t in set(allowed.tolist())
            if t != eos:
                guide.advance(t)
            logits.zero_()
        return times, exact and guide.is_finished()
    return compile_, walk


ENGINES = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine, "outlines-core": outlines_engine}


def version(name: str) -> str:
    from importlib.metadata import version as v

    return v(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="walks per schema (the median per-token time is kept)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from hetero_sd.loading.default_model import default_target_folder

    folder = default_target_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    eos = tokenizer.eos_token_id
    torch.set_num_threads(1)
    results = {"tokenizer": folder.name, "vocab_size": vocab, "cpu": platform.processor() or platform.machine(),
               "threads": 1, "engines": {}}
    for name in args.engines.split(","):
        row = {"version": version(name), "schemas": {}}
        try:
            began = time.perf_counter()
            compile_, walk = ENGINES[name](tokenizer, vocab, eos)
            row["setup_s"] = round(time.perf_counter() - began, 3)  # the tokenizer's vocabulary, once per model
        except Exception as e:  # recorded: an engine that cannot take this tokenizer is a result too
            row["error"] = f"{type(e).__name__}: {e}"
            results["engines"][name] = row
            print(name, row["error"])
            continue
        for label, (schema, value) in SCHEMAS.items():
            ids = answer_ids(tokenizer, value)
            began = time.perf_counter()
            try:
                compiled = compile_(schema)
            except Exception as e:
                row["schemas"][label] = {"error": f"{type(e).__name__}: {e}"}
                continue
            compile_s = time.perf_counter() - began
            per_token, exact = [], True
            for _ in range(args.repeat):
                times, ok = walk(compiled, ids)
                per_token.append(statistics.median(times))
                exact &= ok
            row["schemas"][label] = {"compile_s": round(compile_s, 4), "tokens": len(ids) + 1,
                                     "mask_us_per_token": round(statistics.median(per_token) * 1e6, 1),
                                     "exact": exact}
            print(name, label, row["schemas"][label])
        results["engines"][name] = row
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
