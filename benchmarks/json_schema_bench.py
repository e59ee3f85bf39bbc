"""Which grammar engine enforces JSON schemas for the constrained decoder (hetero_sd/decoding/constrained.py):
xgrammar, llguidance and outlines-core, measured on the default target's tokenizer (SmolLM2, 49,152 tokens).

Per engine and schema: the compile time, then a valid JSON answer (tokenized by the model's own tokenizer)
walked token by token (one thread), timing the mask of the allowed next tokens at each position (the work a constrained
decode step adds per verified row) and checking exactness: every token of the valid answer is allowed where
it comes, and the end is accepted. Writes benchmarks/results/costs/grammar_engines.json.

    .venv/bin/python benchmarks/json_schema_bench.py [--repeat 3]

--decode: the default pair (SmolLM2-135M + its DFlash draft, block "auto") answering 20 extraction prompts, each
with its JSON schema and without it (free text), speculative and autoregressive (T=0): tau, tokens/s and
speedup per mode, the grammar's mask time per step, and whether each constrained speculative answer equals the
constrained autoregressive one token for token. Writes benchmarks/results/decode/json_schema.json.

    .venv/bin/python benchmarks/json_schema_bench.py --decode [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hetero_sd.decoding.costs import cpu_name

OUT = Path(__file__).resolve().parent / "results" / "costs" / "grammar_engines.json"
DECODE_OUT = OUT.parent.parent / "decode" / "json_schema.json"

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


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


S, I, B, N = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}
TASKS = [  # (prompt, schema): extraction and classification, as agents ask for them
    ("Extract the person: 'Maria Lopez is 34 and lives in Lisbon.'", obj({"name": S, "age": I, "city": S})),
    ("Extract the product: 'The X200 headphones cost $129.99 and are in stock.'",
     obj({"product": S, "price": N, "in_stock": B})),
    ("Classify the sentiment of: 'The service was slow but the food was wonderful.'",
     obj({"sentiment": {"enum": ["positive", "negative", "mixed", "neutral"]}, "confidence": N})),
    ("Extract the meeting: 'Team sync on Tuesday at 10:30 in room B2 with Ana and Joe.'",
     obj({"day": S, "time": S, "room": S, "attendees": {"type": "array", "items": S}})),
    ("Extract the address: '221B Baker Street, London NW1 6XE, United Kingdom'",
     obj({"street": S, "city": S, "postcode": S, "country": S})),
    ("List three primary colors as JSON.", obj({"colors": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}})),
    ("Extract the book: '1984 by George Orwell, published in 1949, 328 pages.'",
     obj({"title": S, "author": S, "year": I, "pages": I})),
    ("Extract the flight: 'Flight LH400 from Frankfurt to New York departs at 13:05.'",
     obj({"flight": S, "from": S, "to": S, "departure": S})),
    ("Is 17 a prime number? Answer with the number and a boolean.", obj({"number": I, "is_prime": B})),
    ("Extract the order: 'Order 5521: 2 apples, 3 pears, 1 melon.'",
     obj({"order_id": I, "items": {"type": "array", "items": obj({"name": S, "quantity": I})}})),
    ("Give the capital and population of France.", obj({"country": S, "capital": S, "population": I})),
    ("Extract the contact: 'Call Dr. Kim at +1-555-0142 or kim@clinic.org.'", obj({"name": S, "phone": S, "email": S})),
    ("Classify the support ticket: 'I was charged twice for my subscription this month.'",
     obj({"category": {"enum": ["billing", "technical", "account", "other"]}, "urgent": B})),
    ("Extract the recipe: 'Pancakes need 2 eggs, 200 g flour and 300 ml milk.'",
     obj({"dish": S, "ingredients": {"type": "array", "items": obj({"item": S, "amount": S})}})),
    ("Convert 5 kilometres to miles and give both values.", obj({"kilometres": N, "miles": N})),
    ("Extract the weather: 'Tomorrow in Oslo: snow, -3 degrees, wind 20 km/h.'",
     obj({"city": S, "condition": S, "temperature_c": N, "wind_kmh": N})),
    ("Name a programming language and the year it appeared.", obj({"language": S, "year": I})),
    ("Extract the event: 'The jazz festival runs from June 3 to June 6 in Montreal; tickets from $45.'",
     obj({"event": S, "start": S, "end": S, "city": S, "min_price": N})),
    ("Describe a cat as JSON with its name, age and favourite toys.",
     obj({"name": S, "age": I, "toys": {"type": "array", "items": S}})),
    ("Extract the movie: 'Inception (2010), directed by Christopher Nolan, runs 148 minutes.'",
     obj({"title": S, "year": I, "director": S, "minutes": I})),
]


def decode(max_new: int) -> dict:
    import os

    import hetero_sd

    rt = hetero_sd.load("default", "default")
    warm = [{"role": "user", "content": "Say hi in JSON."}]  # first-call costs (kernels, the grammar's tokenizer)
    for kw in ({}, {"json_schema": {"type": "object"}}):
        rt.generate(warm, max_new_tokens=16, **kw)
        rt.generate(warm, max_new_tokens=16, speculative=False, **kw)
    rows, totals = [], {}
    for prompt, schema in TASKS:
        messages = [{"role": "user", "content": prompt + " Answer in JSON."}]
        row = {"prompt": prompt}
        for label, kw in (("free", {}), ("json", {"json_schema": schema})):
            spec = rt.generate(messages, max_new_tokens=max_new, **kw)
            plain = rt.generate(messages, max_new_tokens=max_new, speculative=False, **kw)
            s = spec.stats
            steps = s.num_drafts + s.plain_steps + 1
            row[label] = {"tokens": len(spec.token_ids), "tau": round(s.tau, 3), "spec_s": round(s.total_s, 4),
                          "plain_s": round(plain.stats.total_s, 4), "plain_tokens": len(plain.token_ids),
                          "equal_to_plain": spec.token_ids == plain.token_ids, "finish": s.finish_reason}
            if s.constrained is not None:
                row[label]["mask_ms_per_step"] = round(1e3 * s.constrained["mask_s"] / steps, 4)
                row[label]["masks_per_step"] = round(s.constrained["masks"] / steps, 2)
                row[label]["valid"] = valid(spec.text, schema)
            t = totals.setdefault(label, {"tokens": 0, "spec_s": 0.0, "plain_tokens": 0, "plain_s": 0.0,
                                          "accepted": 0, "drafts": 0, "mask_s": 0.0, "equal": 0, "valid": 0})
            t["tokens"] += len(spec.token_ids)
            t["spec_s"] += s.total_s
            t["plain_tokens"] += len(plain.token_ids)
            t["plain_s"] += plain.stats.total_s
            t["accepted"] += s.num_accepted_tokens
            t["drafts"] += s.num_drafts
            t["mask_s"] += (s.constrained or {}).get("mask_s", 0.0)
            t["equal"] += spec.token_ids == plain.token_ids
            t["valid"] += bool(row[label].get("valid"))
        print(json.dumps(row), flush=True)
        rows.append(row)
    summary = {}
    for label, t in totals.items():
        spec_tps, plain_tps = t["tokens"] / t["spec_s"], t["plain_tokens"] / t["plain_s"]
        summary[label] = {"tokens_per_s": round(spec_tps, 2), "plain_tokens_per_s": round(plain_tps, 2),
                          "speedup": round(spec_tps / plain_tps, 3),
                          "tau": round(1 + t["accepted"] / t["drafts"], 3) if t["drafts"] else None,
                          "equal_to_plain": f"{t['equal']}/{len(TASKS)}"}
        if label == "json":
            summary[label]["valid"] = f"{t['valid']}/{len(TASKS)}"
            summary[label]["mask_ms_per_token"] = round(1e3 * t["mask_s"] / t["tokens"], 4)
    return {"target": str(rt.info.get("target")), "draft": str(rt.info.get("draft")), "block": str(rt.block),
            "max_new_tokens": max_new, "cpu": cpu_name(),
            "load_average": list(os.getloadavg()), "summary": summary, "tasks": rows}


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


ENGINES = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine, "outlines-core": outlines_engine}


def version(name: str) -> str:
    from importlib.metadata import version as v

    return v(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="walks per schema (the median per-token time is kept)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--decode", action="store_true", help="decode 20 schemas with the default pair instead")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    if args.decode:
        result = decode(args.max_new_tokens)
        DECODE_OUT.parent.mkdir(parents=True, exist_ok=True)
        DECODE_OUT.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["summary"], indent=2))
        print("wrote", DECODE_OUT)
        return
    from transformers import AutoTokenizer

    from hetero_sd.loading.default_model import default_target_folder

    folder = default_target_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    eos = tokenizer.eos_token_id
    torch.set_num_threads(1)
    results = {"tokenizer": folder.name, "vocab_size": vocab, "cpu": cpu_name(),
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
