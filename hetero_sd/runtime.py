"""The Python API: `load` a target (and a DFlash draft), then `generate`, `stream` or `draft_step`.
The loader (`hetero_sd.loading.loader`) resolves and loads the models; the decoding loops are in
`hetero_sd.decoding.loop`."""

from __future__ import annotations

import gc
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator, Sequence

import numpy as np
import torch

from hetero_sd import validate
from hetero_sd.backends.base import DraftBackend, TargetBackend
from hetero_sd.backends.drift import Drift
from hetero_sd.backends.base import logits_of
from hetero_sd.backends.shadow import ShadowedDraft
from hetero_sd.decoding import loop as decoding
from hetero_sd.decoding.constrained import Grammar, grammar_tokenizer, lark_grammar, schema_grammar
from hetero_sd.decoding.controller import AutoBlock, FixedBlock, Memory
from hetero_sd.decoding.cost_cache import code_id, cost_key, costs_for, forget as forget_costs, source_id
from hetero_sd.decoding.costs import backend_dtype
from hetero_sd.decoding.lanes import Lane, Lanes
from hetero_sd.decoding.lookup import CORPUS_FILE, WEIGHT as LOOKUP_WEIGHT, ContextLookup, CorpusTable
from hetero_sd.decoding.sampling import Sampler, SamplingParams, draft_tokens
from hetero_sd.decoding.stats import Stats
from hetero_sd.decoding.timeline import Timeline
from hetero_sd.devices import cpu_bound
from hetero_sd.errors import (ConfigError, DeviceFailedError, InvalidArgumentError, PromptTooLongError,
                              RuntimeClosedError)
from hetero_sd.backends.policy import DEFAULT, LoadPolicy
from hetero_sd.loading.loader import load_models
from hetero_sd.loading.templates import ChatOptions, chat_ids, chat_options

Prompt = str | Sequence[int] | Sequence[dict]
SCHEDULES = decoding.SCHEDULES + ("pipeline",)
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "rule", "speculative", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class Generation:
    token_ids: list[int]  # generated ids only (a stop token, when hit, is the last one)
    text: str
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class StreamEvent:
    token_ids: list[int]  # new this step
    text: str  # new text this step (may lag a token while a UTF-8 character is incomplete)
    accepted: int | None  # drafts accepted this step; None for the prefill token or without a draft
    stats: Stats  # live statistics so far


@dataclass
class DraftStep:
    anchor: int
    tokens: list[int]  # block_size - 1 proposals
    logits: np.ndarray  # float32 [block_size - 1, vocab]


class TextStream:
    """Incremental detokenisation that never emits half a UTF-8 character: tokenizers' DecodeStream, which
    decodes each new token against a few before it (not the whole answer again at every step)."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer's
        self.decoder = DecodeStream(skip_special_tokens=True) if self.backend is not None else None

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        if self.decoder is None:  # a slow (Python) tokenizer: decode the whole text again
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                return ""
            delta, self.text = text[len(self.text):], text
            return delta
        delta = "".join(piece for i in ids if (piece := self.decoder.step(self.backend, i)))
        self.text += delta
        return delta


class Slots:
    """Per-request state: a target and a draft, each with its own KV cache over the runtime's shared
    weights. A generation takes a free pair (or forks a new one) for its whole life and gives it back
    when it ends, so two generations never share a cache, whether they run in two threads or as two
    stream iterators consumed in turn. The lanes still run one job at a time per device; requests
    interleave between jobs, and each one computes exactly what it would compute alone."""

    def __init__(self, target: TargetBackend, draft: DraftBackend | None, target_lane: Lane, draft_lane: Lane):
        self.target, self.draft, self.target_lane, self.draft_lane = target, draft, target_lane, draft_lane
        self.free = [(target, draft)]
        self.lock = threading.Lock()
        # The prefix cache: id(target) -> (the token ids its KV cache holds, how many of them the draft's
        # context holds), recorded when a generation gives its pair back.
        self.held: dict[int, tuple[list[int], int]] = {}

    def take(self, prompt_ids: Sequence[int] = ()) -> tuple[TargetBackend, DraftBackend | None]:
        """A free pair (the one whose caches share the longest prefix with prompt_ids), or a new fork."""
        with self.lock:
            if self.free:
                if not (prompt_ids and self.held):
                    return self.free.pop()
                best = max(range(len(self.free)), key=lambda i: common_prefix(
                    self.held.get(id(self.free[i][0]), ([], 0))[0], prompt_ids))
                return self.free.pop(best)
        return self.fork()

    def fork(self) -> tuple[TargetBackend, DraftBackend | None]:
        """A new pair over the same weights. Forks allocate on the device, so they run on its lane (device-affine
        runtimes need that)."""
        target = self.target_lane.call(self.target.fork)
        return target, None if self.draft is None else self.draft_lane.call(self.draft.fork)

    def give(self, pair: tuple) -> None:
        with self.lock:
            self.free.append(pair)

    def prefork(self, pairs: int) -> None:
        """Fork pairs until `pairs` are free (a server's concurrent requests each take one), on their lanes."""
        while len(self.free) < pairs:
            self.give(self.fork())

    def reusable(self, pair: tuple, prompt_ids: Sequence[int], use_draft: bool) -> int:
        """How many prompt positions this pair's caches already hold (at least one token is left to
        compute: the prefill's logits come from it)."""
        ids, in_draft = self.held.pop(id(pair[0]), ([], 0))
        n = min(common_prefix(ids, prompt_ids), len(prompt_ids) - 1)
        return max(min(n, in_draft) if use_draft else n, 0)

    def remember(self, pair: tuple, req: decoding.Request | None) -> None:
        """What the pair's caches hold after `req` (None: unknown, nothing is reused)."""
        if req is None:
            self.held.pop(id(pair[0]), None)
            return
        ids = list(req.prompt_ids) + req.sampler.history.output
        n = min(len(ids), pair[0].length)  # a budget cut may leave accepted tokens that were never emitted
        drafted = req.draft is pair[1] and pair[1] is not None and not req.stats.fallback
        self.held[id(pair[0])] = (ids[:n], min(n, pair[1].context_length) if drafted else 0)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Runtime:
    """A loaded target (and draft). Safe to share: any number of generations may run at once, from
    threads or as interleaved `stream` iterators; each gets its own caches (Slots) and the device lanes
    serialise the work, so every output is what that generation would produce alone."""

    chat_options = ChatOptions()  # system prompt and chat-template kwargs for chat prompts (templates.py)

    def __init__(self, target: TargetBackend, draft: DraftBackend | None, tokenizer, stop_ids: list[int],
                 info: dict, schedule: str = "sequential", block: str | int = "fixed",
                 memory: Memory | None = None, verify_gate: float | None = None, lookup: float = LOOKUP_WEIGHT,
                 acceptance: str = "auto"):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.stop_ids, self.info = stop_ids, info
        self.notes: list[str] = list(info.get("notes", []))  # announced once per generation, in stats
        self.schedule = check_schedule(schedule)
        self.block = block  # "auto" (the controller), "fixed" (the draft's block size), or a size
        self.verify_gate = verify_gate  # None, or the draft probability below which drafts go unverified
        self.lookup = lookup  # the context lookup's weight in the draft's proposals (0: off)
        self.acceptance = validate.acceptance(acceptance)  # where blocks are accepted (accepted_where)
        self.corpus = corpus_table(info.get("draft"), self.notes) if draft is not None and lookup else None
        self.memory = memory  # the controller's costs and acceptance prior, kept across generations
        self.memory_lock = threading.Lock()  # two first requests must not both measure
        self.costs_rechecked = False
        self.target_lane = Lane("target", target.device)  # torch CPU work inline in the caller's thread (lanes.py)
        self.draft_lane = Lane("draft", draft.device if draft else target.device)
        self.slots = Slots(target, draft, self.target_lane, self.draft_lane)
        self.closed = False
        # Reuse the KV cache and the draft's context of the longest prompt prefix a finished generation
        # left (a new turn of a conversation): `hetero-sd serve` and the chat app turn it on.
        self.prefix_cache = False

    @property
    def block_size(self) -> int:
        return self.draft.block_size if self.draft else 1

    def encode(self, prompt: Prompt, chat: bool = True, options: ChatOptions | None = None) -> tuple[list[int], list[str]]:
        """Token ids for a prompt (checked: types, UTF-8, ids in the vocabulary, not empty); notes say
        what was done that the caller might not expect. options: the chat template's (else the runtime's)."""
        prompt = validate.prompt(prompt)
        ids, notes = self.tokenize(prompt, validate.chat_mode(chat, prompt), options or self.chat_options)
        return validate.token_ids(ids, self.target.config.vocab_size), notes

    def tokenize(self, prompt: Prompt, chat: bool, options: ChatOptions) -> tuple[list[int], list[str]]:
        if isinstance(prompt, str) and not chat:
            return self.tokenizer.encode(prompt, add_special_tokens=True), []
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            return chat_ids(self.tokenizer, messages, options)
        return list(prompt), []

    def stream(self, prompt: Prompt, *, chat: bool = True, stop_at_eos: bool | None = None,
               system_prompt: str | None = None, chat_template_kwargs: dict | None = None,
               **kwargs) -> Iterator[StreamEvent]:
        """Yield one event per verify step (per token without a draft). The last event's stats are final.

        Keywords: max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, seed=None, min_p=0.0,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0 (applied to the target's
        distribution before acceptance: decoding/penalties.py),
        speculative=True (False: the autoregressive baseline on the same backend), rule="match",
        schedule=None (the runtime's: "sequential" or "overlap"), block=None (the runtime's: "auto",
        "fixed" or a size up to the draft's), verify_gate=None (the runtime's: None, or verify only the drafts
        before the first whose draft probability is below it: sampling.gated), lookup=None (the runtime's: the
        context lookup's weight in the draft's proposals, 0 off: decoding/lookup.py), timeline=None (record into
        this one), json_schema=None (a JSON schema, dict or JSON text, the output must follow) or grammar=None
        (a Lark grammar in llguidance's dialect), enforced on the target's distribution before acceptance
        (decoding/constrained.py: lossless; the grammar's record is stats.constrained)."""
        self.check_open()
        prompt = validate.prompt(prompt)
        prompt_ids, notes = self.encode(prompt, chat, self.chat_options.override(system_prompt, chat_template_kwargs))
        return self.decode(prompt_ids, notes, stops_at_eos(prompt, stop_at_eos), **kwargs)

    def decode(self, prompt_ids: list[int], notes: list[str], stop_at_eos: bool, *, max_new_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               min_p: float = 0.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, speculative: bool = True, rule: str = "match", schedule: str | None = None,
               timeline: Timeline | None = None, request: int = 0, draft=None,
               block: str | int | None = None, verify_gate: float | None = None,
               lookup: float | None = None, json_schema=None, grammar: str | None = None) -> Iterator[StreamEvent]:
        """Everything is checked here, before any model work; the returned iterator takes its own
        caches (a slot) when first advanced and gives them back when it ends or is closed.
        draft: another draft over the same target (bench's float32 reference); forked per generation."""
        self.check_open()
        validate.sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed, rule=rule, speculative=speculative, min_p=min_p,
                          repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty)
        validate.optional("timeline", timeline, Timeline, "pass a Timeline (hetero_sd.decoding.timeline) or leave it out")
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                                frequency_penalty)
        constrained = self.grammar(json_schema, grammar, stop_at_eos)
        if schedule == "pipeline":  # asked of one generation: refused, not run sequentially in silence
            raise ConfigError("schedule 'pipeline' needs two requests at once; a generation is one",
                              "use generate_many(prompts, schedule='pipeline'), or schedule='sequential' or 'overlap'")
        schedule = check_schedule(schedule or self.schedule)
        schedule = "overlap" if schedule == "overlap" else "sequential"  # one request: nothing to pipeline
        use_draft = speculative and self.draft is not None
        if use_draft:
            block = validate.block(self.block if block is None else block, self.draft.block_size)
            verify_gate = validate.verify_gate(self.verify_gate if verify_gate is None else verify_gate)
            lookup = validate.lookup(self.lookup if lookup is None else lookup)
        self.check_length(len(prompt_ids), max_new_tokens, self.block_size if use_draft else 1)
        stats = Stats(mode="speculative" if use_draft else "autoregressive",
                      schedule=schedule if use_draft else "sequential",
                      block_size=self.block_size if use_draft else 1, notes=self.notes + notes,
                      timeline=timeline or Timeline(), request=request,
                      draft_format=self.info.get("draft_format") if use_draft else None,
                      target_dtype=self.info.get("target_dtype") or "",
                      draft_dtype=(self.info.get("draft_dtype") or "") if use_draft else "")
        if schedule == "overlap" and use_draft:
            stats.notes += oversubscription(self.target.device, self.draft.device)
        req = decoding.Request(None, None, prompt_ids, sampler_for(params, seed, prompt_ids),
                               decoding.Budget(max_new_tokens, self.stop_ids if stop_at_eos else []),
                               stats, Lanes(self.target_lane, self.draft_lane, stats.timeline, request), rule)
        if constrained is not None:
            stats.constrained = {}
            req.sampler.constraint = constrained.start(stats.constrained)
        if use_draft:
            req.lookup = self.context_lookup(lookup, prompt_ids, stats)
            # lookup blocks (the lookup's guesses without a draft pass) in the sequential loop; the overlap
            # schedule pre-drafts every next block
            req.policy = self.block_policy(block, prompt_ids, req.lookup if schedule == "sequential" else None)
            req.gate = verify_gate
            stats.acceptance = self.accepted_where(req, schedule)
            req.on_device = stats.acceptance == "device"
        loop = (decoding.autoregressive if not use_draft else
                decoding.overlapped if schedule == "overlap" else decoding.speculative)
        return self.events(self.in_slot(req, loop, use_draft, draft), stats, req.policy)

    def accepted_where(self, req: decoding.Request, schedule: str) -> str:
        """'device' where a generation's blocks can be verified and accepted on the device (decoding/loop.py,
        verify_on_device), else 'host' and why. 'auto' asks for the device when the target is on an accelerator:
        on a CPU a read costs nothing and the host's argmax is the faster one (sampling.argmax_rows)."""
        if self.acceptance == "host" or (self.acceptance == "auto" and not accelerator(self.target.device)):
            return "host"
        p = req.sampler.params
        why = [reason for reason, holds in (
            ("the overlap schedule guesses from the drafted tokens", schedule != "sequential"),
            ("penalties", p.penalized), ("a grammar", req.sampler.constraint is not None),
            ("the verify gate", req.gate is not None),
            ("the context lookup under the rejection rule", req.lookup is not None and not p.greedy
             and req.rule == "rejection"),
            ("a DFlash2 selector", str(self.info.get("draft_format") or "").startswith("dflash2")),
            # (the draws' float64 uniforms and sums: MPS has no float64; the greedy read is float32)
            ("sampling on MPS", not p.greedy and torch.device(self.target.device).type == "mps")) if holds]
        return f"host ({', '.join(why)})" if why else "device"

    def grammar(self, json_schema, grammar: str | None, stop_at_eos: bool) -> Grammar | None:
        """The checked grammar of a generation's json_schema or Lark grammar (one of them), or None."""
        if json_schema is not None and grammar is not None:
            raise InvalidArgumentError("json_schema and grammar were both given", "pass one of them")
        if json_schema is None and grammar is None:
            return None
        text = schema_grammar(json_schema) if json_schema is not None else lark_grammar(grammar)
        stops = self.stop_ids if stop_at_eos else []
        return Grammar.build(text, grammar_tokenizer(self.tokenizer, self.target.config.vocab_size, stops),
                             self.target.config.vocab_size, "json_schema" if json_schema is not None else "grammar")

    def context_lookup(self, weight: float, prompt_ids: list[int], stats: Stats) -> ContextLookup | None:
        """The lookup over the prompt, or None: off, or a DFlash2 draft (its selector walks its own candidates;
        said in the stats)."""
        if weight == 0:
            return None
        if str(self.info.get("draft_format") or "").startswith("dflash2"):
            stats.notes.append("context lookup: not applied to a DFlash2 draft (its selector chooses the tokens)")
            return None
        stats.lookup_weight = weight
        return ContextLookup(prompt_ids, weight, corpus=self.corpus)

    def in_slot(self, req: decoding.Request, loop, use_draft: bool, draft=None) -> Iterator[decoding.Step]:
        """Run a decoding loop on caches of its own, taken at its first step and given back at its end.
        With the prefix cache, the pair whose caches share the longest prefix with the prompt is taken,
        and the prefill computes only the rest."""
        cache = self.prefix_cache and draft is None  # bench's reference draft is a fresh fork
        pair = self.slots.take(req.prompt_ids if cache else ())
        whole = False  # the caches hold exactly what the generation emitted (ended, or closed between steps)
        try:
            req.target = pair[0]
            if use_draft:
                req.draft = pair[1] if draft is None else self.draft_lane.call(draft.fork)
                if isinstance(req.draft, ShadowedDraft):  # drift of this generation
                    req.draft.meter = req.stats.drift = Drift(req.draft.device)
            req.lanes.bind(req.target, req.draft)
            if cache:
                req.reuse = req.stats.num_cached_tokens = self.slots.reusable(pair, req.prompt_ids, use_draft)
                req.keep_context = True
            yield from loop(req)
            whole = True
        except GeneratorExit:
            whole = True
            raise
        finally:
            self.slots.remember(pair, req if cache and whole else None)
            self.slots.give(pair)

    def events(self, steps, stats: Stats, policy=None) -> Iterator[StreamEvent]:
        text = TextStream(self.tokenizer)
        began = time.perf_counter()
        try:
            for step in steps:
                stats.total_s = time.perf_counter() - began
                stats.ttft_s = stats.ttft_s or stats.total_s
                yield StreamEvent(step.tokens, text.add(step.tokens), step.accepted, stats)
        finally:  # also when the consumer stops early: device times come from the timeline, once
            stats.close()
            if isinstance(policy, AutoBlock):
                stats.controller = policy.finish()
                self.recheck_costs(policy.memory, stats)

    def recheck_costs(self, memory: Memory, stats: Stats) -> None:
        """Once per runtime: cached costs that the plain steps keep contradicting are dropped, announced."""
        with self.memory_lock:
            with memory.lock:
                if self.costs_rechecked or "cost_key" not in self.info or not memory.cost.stale():
                    return
                factor = memory.cost.plain_factor
            self.costs_rechecked = True
        stats.notes.append(forget_costs(self.info["cost_key"], factor))

    def generate(self, prompt: Prompt, *, chat: bool = True, stop_at_eos: bool | None = None,
                 system_prompt: str | None = None, chat_template_kwargs: dict | None = None,
                 **kwargs) -> Generation:
        """Generate to the end; keyword arguments as for `stream`. system_prompt and chat_template_kwargs
        (e.g. {"enable_thinking": False}) apply to a chat prompt, over the runtime's chat_options."""
        self.check_open()
        prompt = validate.prompt(prompt)
        prompt_ids, notes = self.encode(prompt, chat, self.chat_options.override(system_prompt, chat_template_kwargs))
        return self.collect(prompt_ids, notes, stops_at_eos(prompt, stop_at_eos), **kwargs)

    def draft_step(self, prompt_ids: Sequence[int]) -> DraftStep:
        """The first block after prefill (greedy anchor), for experiments on the draft alone."""
        self.check_open()
        if self.draft is None:
            raise ConfigError("this runtime has no draft", "load it with draft=... to use draft_step")
        prompt_ids = self.encode(prompt_ids)[0]
        self.check_length(len(prompt_ids), 1, self.block_size)
        stats = Stats(timeline=Timeline())
        pair = self.slots.take()
        try:
            req = decoding.Request(*pair, prompt_ids, Sampler(SamplingParams()),
                                   decoding.Budget(1, []), stats, self.lanes(stats.timeline))
            req.lanes.bind(*pair)
            anchor, features = decoding.prefill(req, features=True)
            logits = decoding.first_block(req, anchor, features)
        finally:
            self.slots.give(pair)
        if logits is None:
            raise DeviceFailedError(f"the draft failed on its first block: {stats.fallback}",
                                    "check the draft device (`hetero-sd devices`) and the draft's weights")
        tokens, _ = draft_tokens(req.sampler, logits, "match")
        return DraftStep(anchor, tokens, logits_of(logits).float().cpu().numpy())

    def block_policy(self, block: str | int, prompt_ids: list[int], lookup: ContextLookup | None = None):
        """The per-step block size: the controller (a fresh one per generation, over the runtime's
        memory; with `lookup`, a step may be a lookup block), or a fixed size ("fixed": the draft's own)."""
        if block == "fixed":
            return FixedBlock(self.draft.block_size)
        if block == "auto":
            return AutoBlock(self.draft.block_size, self.controller_memory(), prompt_ids, lookup=lookup)
        return FixedBlock(validate.block(block, self.draft.block_size))

    def controller_memory(self) -> Memory:
        """The controller's memory; a runtime loaded with a fixed block measures its costs on first use."""
        with self.memory_lock:
            if self.memory is None:
                if "cost_key" not in self.info:
                    raise ConfigError("this runtime has no step costs for block='auto' (its draft was set by hand)",
                                      "load it with hetero_sd.load(..., block_size='auto')")
                self.memory = Memory(costs_for(self.target, self.draft, self.info["cost_key"], self.notes),
                                     self.draft.block_size)
            return self.memory

    def lanes(self, timeline: Timeline, request: int = 0) -> Lanes:
        return Lanes(self.target_lane, self.draft_lane, timeline, request)

    def generate_many(self, prompts: Sequence[Prompt], *, schedule: str = "pipeline", chat: bool = True,
                      stop_at_eos: bool | None = None, **kwargs) -> list[Generation]:
        """Generate for several prompts. "pipeline" runs two requests at once, so that one drafts on the
        draft device while the other verifies on the target device; others run one after another.
        All generations share one timeline (stats.timeline) with a request number each. stop_at_eos as for
        `stream` (None: text prompts stop at EOS, token ids run on), for every prompt."""
        self.check_open()
        validate.sampling(**{k: v for k, v in kwargs.items() if k in SAMPLING_KEYS})
        prompts = [validate.prompt(p) for p in validate.prompt_list(prompts)]
        encoded = [self.encode(p, chat) for p in prompts]
        timeline = Timeline()
        jobs = [dict(prompt_ids=ids, notes=notes, stop_at_eos=stops_at_eos(p, stop_at_eos), request=n)
                for n, (p, (ids, notes)) in enumerate(zip(prompts, encoded))]
        if schedule != "pipeline" or self.draft is None or len(jobs) < 2:
            return [self.collect(timeline=timeline, schedule=None if schedule == "pipeline" else schedule,
                                 **job, **kwargs) for job in jobs]
        for job in jobs:
            job["notes"] = job["notes"] + oversubscription(self.target.device, self.draft.device)
        return pipelined(self, jobs, timeline, kwargs)

    def collect(self, prompt_ids, notes, stop_at_eos, **kwargs) -> Generation:
        ids, stats = [], None
        for event in self.decode(prompt_ids, notes, stop_at_eos, **kwargs):
            ids += event.token_ids
            stats = event.stats
        return Generation(ids, self.tokenizer.decode(ids, skip_special_tokens=True), stats, prompt_ids)

    def warms(self) -> bool:
        """Whether a step shape costs something on its first use here (steps captured as CUDA graphs, or compiled:
        torch.compile, mx.compile) and a model can run its shapes ahead (`warm`), so that `serve` and `chat` run
        `warm` before the first answer waits on it."""
        steps, draft = self.info.get("steps", {}), self.draft
        while hasattr(draft, "inner"):  # (a wrapper's warm is its inner draft's)
            draft = draft.inner
        return any(steps.get(role) in ("graphs", "compiled") and model is not None and type(model).warm is not base.warm
                   for role, model, base in (("target", self.target, TargetBackend), ("draft", draft, DraftBackend)))

    def warm(self, positions: int | None = None, pairs: int = 1) -> int:
        """Run now, on each device's lane, every step shape a context of up to `positions` can meet, where a shape
        costs something on its first use (a CUDA graph's capture, a compilation), so that none is paid inside a
        generation; the free pairs' cache content is left as it is. None: every shape of the caches as allocated
        (the whole context where a CUDA cache fits whole; no torch cache grows; an MLX cache, which grows as it
        goes, its first slots): serve's and chat's warm-up. bench's
        passes its longest prompt and answer. `pairs`: first fork pairs until that many are free, as many requests
        at once as a server takes (each fork's cache is allocated as the first's: whole only where it fits). How
        many steps ran."""
        self.check_open()
        if positions is not None:
            positions = validate.integer("positions", positions, 1)
        if validate.integer("pairs", pairs, 1) > 1:
            self.slots.prefork(pairs)
        ran = 0
        for target, draft in list(self.slots.free):
            ran += self.target_lane.call(partial(target.warm, positions))
            if draft is not None:
                ran += self.draft_lane.call(partial(draft.warm, positions))
        return ran

    def close(self) -> None:
        """Stop the device threads (they also stop at interpreter exit). Later calls raise
        RuntimeClosedError; generations in flight finish the job they are in, then raise it too."""
        self.closed = True
        self.target_lane.close()
        self.draft_lane.close()
        gc.unfreeze()  # what load() kept out of the collector's walk is collectable again (this runtime's cycles)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeClosedError("this Runtime was closed", "load a new one (hetero_sd.load) to generate again")

    def check_length(self, prompt_len: int, max_new_tokens: int, block: int) -> None:
        need = prompt_len + max_new_tokens + block
        if need > self.target.max_context:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + block {block} needs "
                f"{need} positions; the target's context is {self.target.max_context}",
                "shorten the prompt or lower max_new_tokens")


def pipelined(rt: Runtime, jobs: list[dict], timeline: Timeline, kwargs: dict) -> list[Generation]:
    """Two request threads take prompts in turn; each generation has its own KV caches over the shared
    weights (Runtime.slots). The lanes serialise each device, so the two requests interleave: A
    verifies while B drafts."""
    results: list[Generation | None] = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="hetero-sd-request") as pool:
        futures = {pool.submit(rt.collect, timeline=timeline, schedule="sequential", **job, **kwargs): job
                   for job in jobs}
        for future in as_completed(futures):  # the first failure cancels the jobs not yet started
            if future.exception() is not None:
                for other in futures:
                    other.cancel()
                raise future.exception()
            results[futures[future]["request"]] = future.result()
    for g in results:
        g.stats.schedule = "pipeline"
    return results


def sampler_for(params: SamplingParams, seed: int | None, prompt_ids: list[int]) -> Sampler:
    sampler = Sampler(params, seed)
    sampler.history.prompt = list(prompt_ids)  # the repetition penalty counts the prompt's tokens too
    return sampler


def accelerator(device: str) -> bool:
    return device.startswith(("cuda", "mps"))


def check_schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    return schedule


def stops_at_eos(prompt: Prompt, asked: bool | None) -> bool:
    """Text and chat prompts stop at EOS; raw token ids run to the length limit unless asked."""
    if asked is not None:
        return validate.flag("stop_at_eos", asked, "pass stop_at_eos=True or False (or None: text stops, token ids run on)")
    return not (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], int))


def load(target: str = "default", draft: str | None = "default", *, target_device: str = "cpu",
         draft_device: str | None = None, schedule: str = "sequential", dtype=None, draft_dtype=None,
         block_size: int | str | None = None, verify_gate: float | None = None, lookup: float = LOOKUP_WEIGHT,
         max_context: int | None = None, cpu_threads: int | None = None, policy: LoadPolicy | None = None,
         system_prompt: str | None = None, chat_template_kwargs: dict | None = None,
         acceptance: str = "auto") -> Runtime:
    """Load a target and optionally a DFlash draft.

    target/draft: a folder in HF format, a hub id (org/name), a .gguf file, or "default" (for the draft:
    the one shipped for the default target; where none ships, decoding is autoregressive and the
    stats say so). draft=None: no draft. draft="random" (or "random:N" for N layers): an untrained
    draft of the right shape, for measuring costs and the machinery.
    schedule: "sequential", "overlap" (pre-draft the next block during verification) or "pipeline"
    (generate_many runs two requests at once). dtype: the target's (a different dtype is a different
    target: baseline and DFlash both run it); draft_dtype: by default float32 beside an int8-row CPU target (its
    matrices then join the target's int8-row kernels), else the dtype the draft is stored in (a float32 checkpoint
    stays float32), a 16-bit draft in bf16 on CPUs with native bf16, else the target's. cpu_threads: torch CPU threads per lane; by default,
    when both lanes are on the CPU and the schedule runs them at once, half the cores each (announced).
    block_size: "auto" (the default): a controller chooses, step by step, plain decoding or a block of
    2 up to the draft's size, from this placement's step costs (measured once per machine and cached
    under the model home) and the acceptance seen so far; "fixed": the draft's own size on every step;
    or a size from 2 to the draft's own, used on every step. verify_gate: None (verify every draft of a block), or a
    draft probability: each block is verified only up to its first draft below it (sampling.gated). lookup: the weight
    of the context lookup in the draft's proposals (0: the draft's alone; decoding/lookup.py). policy: how the backends may store and multiply
    the weights (backends/policy.py: GGUF blocks, fused ops, the GEMM kernel, the draft's int8 head); the
    default allows everything this machine runs; the CLI builds it from the HETERO_SD_* variables. draft="auto": the published draft of a
    known target (loading/pairs.py). system_prompt, chat_template_kwargs: the runtime's chat_options. acceptance:
    where blocks are verified and accepted, "device" (one read of the device a step), "host", or "auto" (the
    device when the target is on CUDA or MPS; Runtime.accepted_where says when a generation needs the host).
    """
    validate.load_args(target=target, draft=draft, target_device=target_device, draft_device=draft_device,
                       schedule=schedule, max_context=max_context)
    check_schedule(schedule)
    lookup = validate.lookup(lookup)
    acceptance = validate.acceptance(acceptance)
    options = chat_options(system_prompt, chat_template_kwargs)  # checked before any model work
    loaded = load_models(target, draft, target_device=target_device, draft_device=draft_device, schedule=schedule,
                         dtype=dtype, draft_dtype=draft_dtype, block_size=block_size, max_context=max_context,
                         cpu_threads=cpu_threads, policy=policy or DEFAULT)
    t, d, info = loaded.target, loaded.draft, loaded.info
    if d is None:
        rt = Runtime(t, None, loaded.tokenizer, loaded.stop_ids, info, schedule)
        rt.chat_options = options
        return settled(rt)
    info["cost_key"] = cost_key(source_id(loaded.target_folder, target), source_id(loaded.draft_folder, info["draft"]),
                                info["target_device"], info["draft_device"],
                                f"{backend_dtype(t)}/{info['draft_dtype']}" + head_key(info), d.block_size,
                                code_id(t, d), policy or DEFAULT)
    rt = Runtime(t, d, loaded.tokenizer, loaded.stop_ids, info, schedule, loaded.block,
                 verify_gate=validate.verify_gate(verify_gate), lookup=lookup, acceptance=acceptance)
    rt.chat_options = options
    if loaded.block == "auto":  # measured now (or read from the cache), not in the middle of a first reply
        rt.controller_memory()
    return settled(rt)


def settled(rt: Runtime) -> Runtime:
    """Everything alive now (the models, tokenizer and tables just loaded) leaves the garbage collector's walk.
    A full collection visits every tracked object: ~150 ms with the default pair loaded, holding the GIL, so a
    decoding thread (and a chat's screen or a server's event loop) stalls that long at random points of a
    generation; frozen, a collection visits only what was made since. Runtime.close() unfreezes them again."""
    gc.collect()  # what loading left as garbage is freed, not frozen
    gc.freeze()
    return rt


def corpus_table(draft, notes: list[str]) -> CorpusTable | None:
    """The context lookup's corpus table beside the draft's weights (hetero-sd draft-lookup), if it has one."""
    try:
        table = CorpusTable.beside(draft)
    except (OSError, ValueError, KeyError, EOFError) as e:  # numpy's refusals: object arrays, a damaged zip, a missing array
        raise ConfigError(f"the draft's {CORPUS_FILE} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})",
                          f"rebuild it with hetero-sd draft-lookup, or delete {CORPUS_FILE} from the draft's folder") from None
    if table is None:
        return None
    notes.append(f"context lookup: with the draft's corpus table ({len(table):,} contexts of its training answers, "
                 f"{CORPUS_FILE})")
    return table


def head_key(info: dict) -> str:
    """A reduced draft head costs less than the full one (and HETERO_SD_DRAFT_VOCAB=off runs the full one
    from the same folder): part of the cost key. Empty for a full head, so those keys stay as they were."""
    rows, _, vocab = (info.get("draft_head") or "").partition(" of ")
    return f"/head {rows}" if rows and vocab != f"{rows} rows" else ""


def oversubscription(target_device: str, draft_device: str) -> list[str]:
    cores = os.cpu_count() or 2
    if cpu_bound(target_device) and cpu_bound(draft_device) and 2 * torch.get_num_threads() > cores:
        return [f"both lanes on the CPU with {torch.get_num_threads()} torch threads each on {cores} cores: "
                f"they will slow each other down (load with cpu_threads={max(1, cores // 2)})"]
    placed = [(torch.device(d).type, torch.device(d).index or 0) for d in (target_device, draft_device)]
    if accelerator(target_device) and placed[0] == placed[1]:
        # both lanes queue on the device's one stream: a pre-draft waits for the verify it was to overlap
        return [f"the draft and the target share {target_device}: its work runs in queue order, so pre-drafting "
                "cannot overlap the verify and only adds work; schedule='sequential' accepts on the device in one read "
                "a block, or place the draft on another device (draft_device='cpu')"]
    return []
