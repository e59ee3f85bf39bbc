"""Prometheus metrics (prometheus_client), named as vLLM names them with the prefix `hetero_sd:` instead
of `vllm:`: the speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted tokens
per position), prompt and generation tokens, finished requests, time to first token and request latency.
One registry per app, so that several servers in one process (the tests) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "hetero_sd:"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class Metrics:
    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model}
        self.labels = labels
        names = ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", names, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", names, registry=r)
        self.request_success = Counter(P + "request_success", "Requests finished, by finish reason",
                                       names + ["finished_reason"], registry=r)
        self.request_errors = Counter(P + "request_errors", "Requests refused or failed, by HTTP status",
                                      names + ["status"], registry=r)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Verified draft blocks", names, registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Drafted tokens verified", names,
                                        registry=r)
        self.num_accepted_tokens = Counter(P + "spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                           names, registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted at each block position (0: first draft)",
                                        names + ["position"], registry=r)
        # the same counters split by output: "constrained" (a JSON schema, json_object or a forced tool call:
        # decoding/constrained.py) or "free" text, and the grammar's own cost
        split = names + ["output"]
        self.output_requests = Counter(P + "output_requests", "Requests finished, by output (constrained or free)",
                                       split, registry=r)
        self.output_tokens = Counter(P + "output_generation_tokens", "Tokens generated, by output", split, registry=r)
        self.output_drafts = Counter(P + "output_spec_decode_num_drafts", "Verified draft blocks, by output", split,
                                     registry=r)
        self.output_draft_tokens = Counter(P + "output_spec_decode_num_draft_tokens", "Drafted tokens verified, by "
                                           "output", split, registry=r)
        self.output_accepted = Counter(P + "output_spec_decode_num_accepted_tokens", "Drafted tokens accepted, by "
                                       "output", split, registry=r)
        self.grammar_masks = Counter(P + "grammar_masks", "Grammar masks computed (rows of constrained blocks)", names,
                                     registry=r)
        self.grammar_mask_seconds = Counter(P + "grammar_mask_seconds", "Seconds spent computing grammar masks", names,
                                            registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", names,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, admission to last token", names,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests generating", names, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests admitted, waiting for a worker", names,
                             registry=r)

    def finished(self, stats, reason: str, ttft_s: float | None, latency_s: float) -> None:
        m = self.labels
        self.prompt_tokens.labels(**m).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(**m).inc(stats.num_generated_tokens)
        self.request_success.labels(**m, finished_reason=reason).inc()
        self.num_drafts.labels(**m).inc(stats.num_drafts)
        self.num_draft_tokens.labels(**m).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(**m).inc(stats.num_accepted_tokens)
        for accepted in stats.accepted_per_step:
            for pos in range(accepted):
                self.accepted_per_pos.labels(**m, position=str(pos)).inc()
        grammar = getattr(stats, "constrained", None)
        kind = {**m, "output": "constrained" if grammar is not None else "free"}
        self.output_requests.labels(**kind).inc()
        self.output_tokens.labels(**kind).inc(stats.num_generated_tokens)
        self.output_drafts.labels(**kind).inc(stats.num_drafts)
        self.output_draft_tokens.labels(**kind).inc(stats.num_draft_tokens)
        self.output_accepted.labels(**kind).inc(stats.num_accepted_tokens)
        if grammar is not None:
            self.grammar_masks.labels(**m).inc(grammar.get("masks", 0))
            self.grammar_mask_seconds.labels(**m).inc(grammar.get("mask_s", 0.0))
        if ttft_s is not None:
            self.ttft.labels(**m).observe(ttft_s)
        self.e2e.labels(**m).observe(latency_s)

    def error(self, status: int) -> None:
        self.request_errors.labels(**self.labels, status=str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
