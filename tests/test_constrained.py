"""Constrained decoding with speculation (hetero_sd/decoding/constrained.py): at T=0 a JSON schema's output
equals constrained autoregressive decoding token for token under every rule and schedule, and validates;
a draft that proposes forbidden tokens (masked away, or slipping past the mask and cut) changes nothing but
speed; at T>0 the output follows the grammar-masked target distribution (chi-square, as test_sampling.py)."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch

import hetero_sd
from hetero_sd.backends.base import DraftBackend
from hetero_sd.decoding import constrained
from hetero_sd.decoding.constrained import Grammar, grammar_tokenizer, lark_grammar
from hetero_sd.decoding.sampling import Sampler, SamplingParams, argmax_rows
from hetero_sd.errors import InvalidArgumentError

from hetero_sd.backends.base import WrappedDraft
from .structured import make_json_draft, make_json_target
from .test_sampling import P_MIN, chi_square_p

MESSAGES = [{"role": "user", "content": "Describe the order as JSON."}]
SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]}, "s": {"type": "string", "maxLength": 6}},
        "required": ["ok", "n", "tag", "s"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"type": "string", "maxLength": 4},
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 3},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"}}, "required": ["id", "items", "paid"], "additionalProperties": False},
    "enum_array": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["a", "bb", "ccc"]}},
    "choice": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"v": {"type": "number"}},
                                                 "required": ["v"], "additionalProperties": False}]},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = make_json_target(tmp_path_factory.mktemp("json-target"))
    return target, make_json_draft(tmp_path_factory.mktemp("json-draft"), target)


@pytest.fixture(scope="module")
def rt(folders):
    runtime = hetero_sd.load(str(folders[0]), str(folders[1]), block_size="fixed", cpu_threads=1)
    yield runtime
    runtime.close()


def plain(rt, schema, **kw):
    return rt.generate(MESSAGES, max_new_tokens=96, json_schema=schema, speculative=False, **kw)


CONFIGS = [dict(rule="match"), dict(rule="rejection"), dict(schedule="overlap"), dict(block=3),
           dict(verify_gate=0.5)]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_greedy_constrained_output_equals_constrained_autoregressive(rt, name, config):
    schema = SCHEMAS[name]
    want = plain(rt, schema)
    got = rt.generate(MESSAGES, max_new_tokens=96, json_schema=schema, **config)
    assert got.token_ids == want.token_ids
    assert got.stats.finish_reason == want.stats.finish_reason == "stop"  # the grammar completed
    jsonschema.validate(json.loads(got.text), schema)
    assert got.stats.num_drafts > 0 and got.stats.constrained["kind"] == "json_schema"
    assert got.stats.constrained["masks"] > 0


def test_free_text_is_not_json_and_json_object_is(rt):
    """The control: the random target's free text is no JSON; json_object makes it a JSON object."""
    free = rt.generate(MESSAGES, max_new_tokens=24)
    with pytest.raises(ValueError):
        json.loads(free.text)
    got = rt.generate(MESSAGES, max_new_tokens=200, json_schema={"type": "object"})
    assert got.token_ids == rt.generate(MESSAGES, max_new_tokens=200, json_schema={"type": "object"},
                                        speculative=False).token_ids
    assert got.stats.finish_reason == "stop" and isinstance(json.loads(got.text), dict)


class Forbidden(WrappedDraft):
    """A draft whose every row puts almost all its mass on the mask token, which no JSON grammar allows."""

    def __init__(self, inner: DraftBackend, token: int = 3):
        super().__init__(inner)
        self.token = token

    def fork(self):
        return Forbidden(self.inner.fork(), self.token)

    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        logits = self.inner.propose(anchor, position, size).clone()
        logits[:, self.token] = 1e4
        return logits


def with_draft(rt, draft):
    from hetero_sd.runtime import Runtime

    return Runtime(rt.target, draft, rt.tokenizer, rt.stop_ids, rt.info, rt.schedule, "fixed")


@pytest.mark.parametrize("rule,temperature", [("match", 0.0), ("rejection", 0.0), ("rejection", 1.0)])
def test_a_draft_proposing_forbidden_tokens_changes_nothing_but_speed(rt, rule, temperature):
    bad = with_draft(rt, Forbidden(rt.draft))
    for schema in SCHEMAS.values():
        kw = dict(max_new_tokens=96, json_schema=schema, temperature=temperature, seed=7)
        want = plain(rt, schema, temperature=temperature, seed=7)
        got = bad.generate(MESSAGES, rule=rule, **kw)
        if temperature == 0 or rule == "match":
            assert got.token_ids == want.token_ids
        jsonschema.validate(json.loads(got.text), schema)


def test_proposals_past_the_mask_are_cut_before_verification(rt, monkeypatch):
    """Proposals not drawn from masked rows (a selector's walk, a lookup block) reach `proposals`: here every
    DFlash block is proposed unmasked by a draft that prefers a forbidden token, and is cut there."""
    def unmasked(self, sampler, draft_logits, rule):
        return argmax_rows(draft_logits.float()), None
    monkeypatch.setattr(constrained.Constraint, "draft", unmasked)
    bad = with_draft(rt, Forbidden(rt.draft))
    for schema in SCHEMAS.values():
        want = plain(rt, schema)
        got = bad.generate(MESSAGES, max_new_tokens=96, json_schema=schema)
        assert got.token_ids == want.token_ids
        assert got.stats.constrained["cut_drafts"] > 0 and got.stats.num_accepted_tokens == 0


def test_bad_grammars_are_refused_before_any_model_work(rt):
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        rt.generate(MESSAGES, json_schema="{nope")
    with pytest.raises(InvalidArgumentError, match="must be a JSON object"):
        rt.generate(MESSAGES, json_schema=[1, 2])
    with pytest.raises(InvalidArgumentError, match="both given"):
        rt.generate(MESSAGES, json_schema={"type": "object"}, grammar="start: /a/")
    with pytest.raises(InvalidArgumentError, match="cannot be enforced"):
        rt.generate(MESSAGES, grammar="start: undefined_rule")


# T>0: three tokens from a 3-letter regular language, enumerated exactly (27 outcomes)
LETTERS = "start: /[abc]{3,6}/"
N = 700
PROMPT = [2, 90, 88, 74, 87, 204]  # a short raw prompt: ~25% faster generations than the chat turn


def exact_joint(rt, folder, params: SamplingParams, prompt: list[int], steps: int = 3) -> dict[tuple, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    grammar = Grammar.build(lark_grammar(LETTERS), grammar_tokenizer(rt.tokenizer, rt.target.config.vocab_size, []),
                            rt.target.config.vocab_size, "grammar")
    joint = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, mass in joint.items():
            sampler = Sampler(params)
            sampler.constraint = grammar.start()
            sampler.constraint.advance(list(prefix))
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[:, -1]
            p = sampler.probs(logits).double()[0]
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = mass * p[t].item()
        joint = nxt
    return joint


@pytest.mark.parametrize("rule,params", [("rejection", SamplingParams(1.0)), ("match", SamplingParams(0.8, top_k=2))],
                         ids=["rejection-T1", "match-T0.8-k2"])
def test_constrained_samples_follow_the_masked_target_distribution(rt, folders, rule, params):
    prompt = PROMPT
    samples, totals = [], Counter()
    for seed in range(N):
        g = rt.generate(prompt, max_new_tokens=3, grammar=LETTERS, temperature=params.temperature,
                        top_k=params.top_k, seed=seed, rule=rule)
        samples.append(tuple(g.token_ids))
        totals.update(accepted=g.stats.num_accepted_tokens, drafted=g.stats.num_draft_tokens)
    joint = exact_joint(rt, folders[0], params, prompt)
    assert len(joint) >= 8  # the grammar (and top-k) leave a real choice at each step
    p = chi_square_p(samples, joint)
    assert p > P_MIN, f"constrained samples do not follow the masked target distribution (chi-square p = {p:.2e})"
    assert 0 < totals["accepted"] < totals["drafted"]  # both branches of the rule ran


def test_generate_command_takes_a_json_schema_file(folders, tmp_path, capsys):
    from hetero_sd.cli.main import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["flat"]))
    args = ["generate", "Describe the order as JSON.", "--target", str(folders[0]), "--draft", str(folders[1]),
            "--block-size", "fixed", "--max-new-tokens", "96", "--json-schema", str(schema)]
    assert main(args) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMAS["flat"])
    schema.write_text("[1]")
    assert main(args) != 0
    assert "--json-schema" in capsys.readouterr().err


def test_a_dflash2_selector_under_a_grammar(folders, tmp_path):
    """A DFlash2 draft's selector walks its own candidates (not masked rows): its proposals are cut at the first
    forbidden token under greedy and match, and left to the rejection rule at T>0 (a forbidden draft has p = 0)."""
    from . import reference_dflash as ref

    pytest.importorskip("dflash", reason="z-lab's reference package builds the DFlash2 draft")
    ref.make_reference_draft(tmp_path, dflash2=True, vocab=constrained_vocab(folders[0]))
    rt2 = hetero_sd.load(str(folders[0]), str(tmp_path), block_size="fixed", cpu_threads=1)
    try:
        assert rt2.info["draft_format"].startswith("dflash2")
        cut = 0
        for schema in SCHEMAS.values():
            want = plain(rt2, schema)
            got = rt2.generate(MESSAGES, max_new_tokens=96, json_schema=schema)
            assert got.token_ids == want.token_ids and got.stats.num_drafts > 0
            cut += got.stats.constrained["cut_drafts"]
            sampled = rt2.generate(MESSAGES, max_new_tokens=96, json_schema=schema, temperature=1.0, seed=3,
                                   rule="rejection")
            if sampled.stats.finish_reason == "stop":
                jsonschema.validate(json.loads(sampled.text), schema)
        assert cut > 0  # the selector did propose forbidden tokens, and they were cut
    finally:
        rt2.close()


def constrained_vocab(folder) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]
