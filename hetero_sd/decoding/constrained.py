"""Output constrained by a grammar (a JSON schema, or a Lark grammar with embedded schemas), with speculation
kept lossless. The grammar engine is llguidance: at SmolLM2's 49,152 tokens it computes a mask in ~38 us a
token, compiles a schema in under a millisecond, accepts every valid answer token by token and rolls back
(benchmarks/json_schema_bench.py: xgrammar ~160 us a mask, outlines-core ~5 s to compile a free JSON object).

The sampler consults one `Constraint` per generation (`Sampler.constraint`); its matcher holds the grammar
state after the tokens emitted so far, and nothing else. Invariants:
- Target rows. Row i of a verified block is the distribution after the anchor and drafted[:i], so it is
  masked by the grammar state after drafted[:i] (`Sampler.penalize`, where the penalties condition on
  drafted[:i] the same way). The acceptance rules then keep the constrained distribution exactly: at T=0
  the output is constrained greedy decoding token for token; at T>0 it follows the masked, renormalised
  target distribution. Rows after a draft the grammar forbids are left unmasked: no rule reaches them
  (greedy and `match` stop at the first mismatch, `rejection` rejects a draft whose p is zero).
- Draft rows (a DFlash block's logits). Row i is masked by the state after drafted[:i] and the proposal
  taken from it (greedy / `match`: its maximum; `rejection`: a draw from the masked q_i, which is then the
  distribution it came from, all the rule needs). The draft never proposes a forbidden token, and the
  masks are the ones the target's rows need: computed once a block.
- Proposals that are not drawn from logits (a DFlash2 selector's walk, a lookup block's guesses) are cut at
  the first token the grammar forbids under greedy and `match` (every emitted token is the target's there,
  so a shorter block changes only the speed). Under `rejection` at T>0 they are not cut: a cut chosen by a
  drawn token's own value biases the rule (see sampling.gated); the forbidden draft has p = 0 and is
  rejected there, with the residual drawn from the constrained p.
- The state advances by emitted tokens only (`advance`, from `Sampler.emitted`); a block's masks are taken
  by consuming its drafts and rolling them back. When the grammar is complete (only its end may follow),
  `finished` is true and the loop ends the generation ("stop").
The context lookup is not mixed into a constrained DFlash block's rows (its guesses would have to be
masked too); lookup blocks still run and are cut as above."""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from hetero_sd.backends.base import SelectorBlock
from hetero_sd.errors import InvalidArgumentError

# The JSON the grammar admits: json.dumps's separators and no other whitespace. Free whitespace would let a
# model pad an answer with newlines until its token budget runs out.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab, stops): LLTokenizer}
_BUILDING = threading.Lock()  # a server's first constrained requests arrive together: one build


def grammar_tokenizer(tokenizer, vocab_size: int, stop_ids) -> object:
    """llguidance's view of a Hugging Face fast tokenizer (building it reads the whole vocabulary: ~0.2 s at
    49k tokens), kept per tokenizer. stop_ids: the tokens that end a generation (the grammar's end)."""
    import llguidance.hf

    key = (vocab_size, tuple(sorted(stop_ids)))
    with _BUILDING:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            try:
                per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(key[1]) or None)
            except ValueError as e:
                raise InvalidArgumentError(f"constrained output needs a fast (Rust) tokenizer ({e})",
                                           "load a model whose folder has a tokenizer.json") from None
        return per[key]


def parse_schema(schema, where: str = "the JSON schema") -> dict:
    """A JSON schema given as a dict or as its JSON text, checked to be a JSON object; errors name `where`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"{where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})",
                                       'write a JSON object, e.g. {"type": "object"}') from None
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"{where} must be a JSON object, not {type(schema).__name__}",
                                   'write e.g. {"type": "object", "properties": {...}}')
    return schema


def schema_grammar(schema) -> str:
    """llguidance's grammar for a JSON schema (a dict, or its JSON text)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(parse_schema(schema), defaults=COMPACT)


def lark_grammar(text: str) -> str:
    """llguidance's grammar for a Lark grammar (llguidance's dialect: `%json {schema}` embeds a schema,
    `<[id]>` matches one special token)."""
    import llguidance

    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError("the grammar is empty or not text", "pass a Lark grammar with a `start` rule")
    return llguidance.LLMatcher.grammar_from_lark(text)


@dataclass(frozen=True)
class Grammar:
    """A checked grammar for one tokenizer: start a `Constraint` from it for each generation."""

    text: str  # llguidance's serialised grammar
    tokenizer: object  # llguidance's LLTokenizer
    vocab_size: int
    kind: str  # "json_schema", "grammar": what the stats call it

    @classmethod
    def build(cls, grammar: str, tokenizer, vocab_size: int, kind: str) -> "Grammar":
        import llguidance

        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if error:
            what = "JSON schema" if kind == "json_schema" else "grammar"
            raise InvalidArgumentError(f"the {what} cannot be enforced: {messages[0].strip().splitlines()[0]}",
                                       f"fix the {what} (llguidance's JSON-schema and Lark support)")
        return cls(grammar, tokenizer, vocab_size, kind)

    def start(self, record: dict | None = None) -> "Constraint":
        return Constraint(self, record)


class Constraint:
    """One generation's grammar state and the masks of its current block (see the module's docstring)."""

    def __init__(self, grammar: Grammar, record: dict | None = None):
        import llguidance

        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text)
        if self.matcher.is_error():
            raise InvalidArgumentError(f"the grammar cannot start: {self.matcher.get_error()}", "fix the grammar")
        self.vocab = grammar.vocab_size
        self.words = (self.vocab + 31) // 32
        self.emitted = 0
        self.memo: tuple | None = None  # (emitted, drafts, forbidden [rows, V] bool) of the current block
        # what the stats report (Stats.constrained): kept live, one dict per generation
        self.record = record if record is not None else {}
        self.record.update(kind=grammar.kind, masks=0, mask_s=0.0, cut_drafts=0)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but its end (a stop token) may follow."""
        return self.matcher.is_stopped()

    def advance(self, tokens: list[int]) -> None:
        """The emitted tokens, in order. Every one was allowed by a mask; a refusal here is a broken invariant."""
        for t in tokens:
            if self.matcher.is_stopped():
                break  # the grammar's end (a stop token) was emitted: nothing more is constrained
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"the grammar refused emitted token {t}: {self.matcher.get_error()}")
        self.emitted += len(tokens)
        self.memo = None

    def through_end(self, tokens: list[int]) -> list[int]:
        """tokens up to the one that completes the grammar (a verified block may bring the grammar's end and
        a bonus after it: autoregressive decoding would have stopped there)."""
        n = 0
        try:
            while n < len(tokens) and not self.matcher.is_stopped():
                if not self.matcher.consume_token(int(tokens[n])):
                    raise RuntimeError(f"the grammar refused token {tokens[n]} that it had allowed: "
                                       f"{self.matcher.get_error()}")
                n += 1
            return tokens[:n]
        finally:
            if n:
                self.matcher.rollback(n)

    def forbidden(self, drafted: list[int], rows: int) -> tuple[np.ndarray, int]:
        """[m, V] bool: row i the tokens forbidden after the emitted tokens and drafted[:i], for the first m =
        min(rows, valid + 1) rows, where the first `valid` drafts are allowed in order. Rows past m are not
        masked (no rule reaches them). A block drafted under the grammar (`draft`) left its rows here."""
        drafted = list(drafted)[:rows - 1]
        if self.memo is not None and self.memo[0] == self.emitted:
            known, forbidden = self.memo[1], self.memo[2]
            if len(drafted) <= len(known) and known[:len(drafted)] == drafted:
                return forbidden[:len(drafted) + 1], len(drafted)
        began = time.perf_counter()
        valid = self.matcher.validate_tokens(drafted) if drafted else 0
        forbidden = self.unpack(self.walk(drafted[:valid]))
        self.memo = (self.emitted, drafted[:valid], forbidden)
        self.record["masks"] += forbidden.shape[0]
        self.record["mask_s"] += time.perf_counter() - began
        return forbidden[:rows], valid

    def walk(self, tokens: list[int], choose=None, rows: int = 0) -> torch.Tensor:
        """Bit masks of the states after tokens[:i], i = 0..len(tokens), consuming each token after its row
        and rolling them all back. choose(i, bit row i) -> the token to append to `tokens` (`draft`: the tokens
        are chosen as the rows come, `rows` of them at most)."""
        n = len(tokens) if choose is None else rows
        bits = torch.zeros(n + 1, self.words, dtype=torch.int32)
        consumed, i = 0, 0
        try:
            while True:
                row = bits[i]  # llguidance writes the mask into the row's memory (llguidance.torch's helper
                # does the same, but importing that module costs ~0.8 s: it sets up torch.compile)
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
                if i == n or self.matcher.is_stopped():
                    break  # past the last token, or the grammar is complete: only its end may follow
                if choose is not None:
                    token = choose(i, bits[i:i + 1])
                    tokens.append(token)
                if not self.matcher.consume_token(int(tokens[i])):
                    raise RuntimeError(f"the grammar refused token {tokens[i]} that it had allowed: "
                                       f"{self.matcher.get_error()}")
                consumed += 1
                i += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return bits[:i + 1]

    def unpack(self, bits: torch.Tensor) -> np.ndarray:
        """Bit rows -> forbidden rows [m, V] (bool), in numpy: torch's CPU `any` over 9 x 49k booleans took ~13 ms
        on the busy 2-core Zen 5 (its threads contend), numpy's unpack and checks ~0.1 ms."""
        words = bits.numpy()
        forbidden = np.logical_not(np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :self.vocab])
        forbidden[~words.any(-1)] = False  # a state that admits nothing (after the end): no row is all -inf
        return forbidden

    @staticmethod
    def apply(logits: torch.Tensor, forbidden: np.ndarray) -> torch.Tensor:
        """Float logits with their first forbidden.shape[0] rows masked (-inf where forbidden); a new tensor.
        A CPU float32 tensor is masked in numpy (copy + putmask ~3 ms at 16 x 49k rows; torch's masked_fill
        took 3-44 ms there, as its two threads contend with the lanes')."""
        m = forbidden.shape[0]
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
            out = np.array(logits.numpy(), copy=True)
            np.putmask(out[:m], forbidden, np.float32(-np.inf))
            return torch.from_numpy(out)
        mask = torch.from_numpy(forbidden).to(logits.device)
        if m == logits.shape[0]:
            return logits.masked_fill(mask, float("-inf"))
        out = logits.clone()
        out[:m] = out[:m].masked_fill(mask, float("-inf"))
        return out

    def mask(self, logits: torch.Tensor, drafted=None) -> torch.Tensor:
        """Row i of float logits masked by the state after drafted[:i] (rows past a forbidden draft as they are)."""
        forbidden, _ = self.forbidden(list(drafted or []), logits.shape[0])
        return self.apply(logits, forbidden)

    def draft(self, sampler, draft_logits, rule: str) -> tuple[list[int], torch.Tensor | None]:
        """The block's proposals under the grammar, and q where the rule needs it (sampling.draft_tokens):
        row i masked by the state after the proposals before it. The block's masks stay for its verification."""
        if isinstance(draft_logits, SelectorBlock):
            return draft_logits.choose(sampler, rule)  # cut (greedy, match) or left to the rule: `proposals`
        from .sampling import argmax_rows

        greedy = sampler.params.greedy or rule == "match"
        qs: list[torch.Tensor] = []

        def choose(i: int, bits: torch.Tensor) -> int:
            row = self.apply(draft_logits[i:i + 1].float(), self.unpack(bits))
            if greedy:
                return argmax_rows(row)[0]
            held, sampler.constraint = sampler.constraint, None  # row is masked already
            try:
                q = sampler.probs(row)  # penalties keep -inf at -inf; then temperature and the filters
            finally:
                sampler.constraint = held
            qs.append(q)
            return int(sampler.draw(q, i, "draft")[0])

        began = time.perf_counter()
        tokens: list[int] = []
        bits = self.walk(tokens, choose, draft_logits.shape[0])
        self.memo = (self.emitted, list(tokens), self.unpack(bits))
        self.record["masks"] += bits.shape[0]
        self.record["mask_s"] += time.perf_counter() - began
        if greedy:
            return tokens, None
        return tokens, (torch.cat(qs) if qs else torch.zeros(0, draft_logits.shape[-1]))

    def proposals(self, sampler, drafted: list[int], q: torch.Tensor | None, rule: str):
        """Proposals cut at the first token the grammar forbids (greedy and match; see the docstring)."""
        if not (sampler.params.greedy or rule == "match") or not drafted:
            return drafted, q
        valid = self.matcher.validate_tokens(list(drafted))
        if valid < len(drafted):
            self.record["cut_drafts"] += len(drafted) - valid
            drafted, q = drafted[:valid], (q[:valid] if q is not None else None)
        return drafted, q
