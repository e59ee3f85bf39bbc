"""A runtime double for the chat app: streams a fixed answer at a set speed, as the engine would, so the
app's own cost can be measured apart from the model's."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hetero_sd.decoding.stats import Stats
from hetero_sd.runtime import StreamEvent


def line_tokenizer(vocab: int = 64):
    """A tokenizer whose ids decode to "w<id> " words, every eighth one ending its line (a newline,
    not a space), joined as they are: lines of eight words, as an answer's lines come."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = {(f"w{i}\n" if i % 8 == 7 else f"w{i} "): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(pieces, unk_token="w0 "))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0 ")


class PacedRuntime:
    """Streams `tokens` tokens at `rate` tokens/s (None: as fast as it can) in verify steps of `block`
    tokens (tau = block), paced on the wall clock by sleeping to each step's due time: like the engine's
    native compute, the pacing does not hold the GIL, and a consumer that keeps up never delays it.
    Without a draft (speculative=False, the baseline) it runs at rate / block. `walls` holds each stream's
    wall time from its start to its last event being consumed."""

    def __init__(self, tokenizer, tokens: int = 5000, rate: float | None = 5000.0, block: int = 4,
                 first_id: int = 5, vocab: int = 64):
        self.tokenizer, self.tokens, self.rate, self.block = tokenizer, tokens, rate, block
        self.first_id, self.vocab = first_id, vocab
        self.info = {"target": "paced", "target_device": "cpu", "draft": "paced-draft", "draft_device": "cpu"}
        self.notes: list[str] = []
        self.prefix_cache = False
        self.walls: list[float] = []
        self.prompts: list = []
        self.target = SimpleNamespace(max_context=1 << 20)  # room for any answer

    def close(self) -> None:
        pass

    def warms(self) -> bool:
        return False  # no step shape costs anything on its first use

    def encode(self, prompt, chat: bool = True, options=None) -> tuple[list[int], list[str]]:
        return self.ids(0, 8), []

    def generate(self, prompt, **kwargs):
        stats = None
        for event in self.stream(prompt, **kwargs):
            stats = event.stats
        return SimpleNamespace(stats=stats)

    def ids(self, start: int, count: int) -> list[int]:
        span = self.vocab - self.first_id
        return [self.first_id + (start + i) % span for i in range(count)]

    def stream(self, prompt, *, max_new_tokens: int = 256, speculative: bool = True, stop_at_eos=None,
               **kwargs):
        self.prompts.append(prompt)
        return self.events(min(self.tokens, max_new_tokens), speculative)

    def events(self, count: int, speculative: bool):
        block = self.block if speculative else 1
        rate = None if self.rate is None else (self.rate if speculative else self.rate / self.block)
        stats = Stats(mode="speculative" if speculative else "autoregressive", block_size=self.block if speculative else 1)
        began = time.perf_counter()
        emitted = 0
        while emitted < count:
            step = min(block, count - emitted)
            if rate is not None:
                delay = began + (emitted + step) / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            ids = self.ids(emitted, step)
            emitted += step
            if speculative:
                stats.record_step(block - 1, step - 1)
            stats.record_emitted(step, "length" if emitted == count else "")
            stats.total_s = time.perf_counter() - began
            yield StreamEvent(ids, "", step - 1 if speculative else None, stats)
        self.walls.append(time.perf_counter() - began)

    def alone(self, count: int) -> float:
        """Wall time of a stream of `count` tokens consumed by nothing but a loop."""
        began = time.perf_counter()
        for _ in self.events(count, True):
            pass
        self.walls.pop()
        return time.perf_counter() - began
