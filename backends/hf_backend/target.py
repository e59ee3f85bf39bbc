"""A target run by transformers' own model class (AutoModelForCausalLM) on a torch device: any family
the library has, hybrid (Gated DeltaNet + attention), MoE and sliding-window included.

Context features: forward hooks on the draft's decoder layers (and on the final norm for the last
layer) record exactly the entries of `output_hidden_states` the draft reads (i+1: layer i's output;
the last after the final norm: base.feature_parts' arrangement, what z-lab's drafts were trained on)
without keeping every layer's states; a model without `layers`/`norm` on its decoder falls back to
`output_hidden_states`.

The cache keeps exactly the accepted prefix. transformers' `activate_past_recording` makes attention,
sliding-window and convolution caches keep a forward's new positions until the next `crop`, which may
remove any of them (`Cache.crop(-k)`); `crop(0)` then trims windows to their working size. A recurrent
state (linear attention) cannot be cropped: it is snapshotted at the start of every forward, and a
rollback into the block restores it and re-runs the accepted prefix from the block's start (z-lab's MLX
approach). A crop further back than the last forward re-runs the prefix from position 0 (announced in
`recomputes`; the decoding loop never does it, the cost probe and prefill do at most once)."""

from __future__ import annotations

import inspect
import threading
from typing import Sequence

import torch

from hetero_sd.errors import PromptTooLongError
from hetero_sd.models.config import ArchConfig

from ..base import TargetBackend, TargetOutput, synchronize


class Capture:
    """Hooks on one model's decoder that record the chosen layers' outputs while `active`. Shared by a
    target and its forks, whose forwards may run at once in different threads: hooks run in the thread
    that called the model, so the state is per thread."""

    def __init__(self, model, layer_ids: Sequence[int]):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        self.ok = decoder is not None and hasattr(decoder, "layers") and hasattr(decoder, "norm")
        self.state, self.last = threading.local(), None
        if not self.ok:
            return
        self.last = len(decoder.layers) - 1
        for i in sorted(set(layer_ids)):
            if i == self.last:  # the last layer's features are after the final norm
                decoder.norm.register_forward_hook(self.hook(i))
            else:
                decoder.layers[i].register_forward_hook(self.hook(i))

    def hook(self, index: int):
        def record(module, args, output):
            if getattr(self.state, "outputs", None) is not None:
                self.state.outputs[index] = output[0] if isinstance(output, tuple) else output
        return record


class HFTarget(TargetBackend):
    path = "transformers"  # which path the runtime took for this target (stats notes, `devices`)

    def __init__(self, model, cfg: ArchConfig, device: str, dtype: torch.dtype, layer_ids: Sequence[int],
                 max_context: int, notes: list[str] | None = None, capture: Capture | None = None):
        self.model, self.config, self.device, self.dtype = model, cfg, device, dtype
        self.capture = capture or Capture(model, layer_ids)
        self.layer_ids, self.max_context = list(layer_ids), max_context
        self.notes = notes if notes is not None else []
        self.embed = model.get_input_embeddings().weight.detach()  # [vocab, hidden]: the draft shares them
        self.lm_head = model.get_output_embeddings().weight.detach().t()  # [hidden, vocab]
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self.ids: list[int] = []
        self.block_start = 0  # where the last forward began
        self.snapshot: list | None = None  # recurrent states at block_start
        self.settled = True  # windows trimmed since the last forward (crop(0) called)
        self.recomputes = 0  # crops that re-ran the prefix from position 0
        self.cache = self.new_cache()
        self.has_recurrent = False  # known after the first forward (layers initialise lazily)

    @property
    def length(self) -> int:
        return len(self.ids)

    def new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording()
        return cache

    def recurrent_layers(self) -> list:
        return [layer for layer in self.cache.layers if hasattr(layer, "recurrent_states")]

    def take_snapshot(self) -> list | None:
        """The recurrent states now (None at position 0: a fresh cache is the start state)."""
        if not self.ids or not self.has_recurrent:
            return None
        return [{i: s.clone() for i, s in layer.recurrent_states.items() if s is not None}
                for layer in self.recurrent_layers()]

    def restore_snapshot(self) -> None:
        for layer, states in zip(self.recurrent_layers(), self.snapshot):
            for i, s in states.items():
                layer.recurrent_states[i].copy_(s)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], *, hidden: bool, last_only: bool):
        """Append `ids` to the cache; the recurrent states before them are kept until the next run."""
        self.settle()
        self.block_start, self.snapshot = len(self.ids), self.take_snapshot()
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        hooks = hidden and self.capture.ok
        self.capture.state.outputs = {} if hooks else None
        try:
            out = self.model(input_ids=x, use_cache=True, output_hidden_states=hidden and not hooks,
                             logits_to_keep=1 if last_only else 0, **{self.cache_arg: self.cache})
            out.captured = self.capture.state.outputs
        finally:
            self.capture.state.outputs = None
        self.ids.extend(int(i) for i in ids)
        self.settled = False
        if not self.has_recurrent:
            self.has_recurrent = bool(self.recurrent_layers()) and any(
                s is not None for layer in self.recurrent_layers() for s in layer.recurrent_states.values())
        return out

    def forward(self, token_ids: Sequence[int], *, last_only: bool = False, features: bool = True) -> TargetOutput:
        if len(self.ids) + len(token_ids) > self.max_context:
            raise PromptTooLongError(f"{len(self.ids) + len(token_ids)} positions exceed the target's context of "
                                     f"{self.max_context}", "shorten the prompt or lower max_new_tokens")
        capture = features and bool(self.layer_ids)
        out = self.run(token_ids, hidden=capture, last_only=last_only)
        logits = out.logits[0].float()
        feats = None
        if capture:
            if self.capture.ok:
                got = out.captured
                feats = torch.cat([got[i][0] for i in self.layer_ids], dim=-1)  # every position, as the draft needs
            else:
                states = out.hidden_states  # [embeddings, layer 0, ..., last layer after the final norm]
                feats = torch.cat([states[i + 1][0] for i in self.layer_ids], dim=-1)
        return TargetOutput(logits=logits, features=feats)

    def settle(self) -> None:
        if not self.settled:
            self.cache.crop(0)  # trims sliding windows and convolution histories to their working size
            self.settled = True

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Keep positions < length. A cut inside the last forward's block uses the history the cache
        recorded for it; a cut further back (a prefix cache's, the cost probe's) re-runs the prefix,
        except where every layer is full attention (cut in place)."""
        length = max(0, int(length))
        if length >= len(self.ids):
            return
        if length == 0:
            self.reset()
        elif self.full_attention_only():  # every position kept: cut anywhere (a prefix cache's crops too)
            self.cache.crop(-(len(self.ids) - length))
            del self.ids[length:]
        elif self.settled or length < self.block_start:
            self.recompute(length)
        elif not self.has_recurrent:
            self.cache.crop(-(len(self.ids) - length))
            del self.ids[length:]
            self.settled = True  # that crop trimmed the sliding windows to their size: no further cut back
        elif self.snapshot is None:  # the block began at position 0: its start state is a fresh cache
            self.recompute(length)
        else:  # recurrent layers: back to the block's start state, then the accepted prefix again
            start, kept = self.block_start, self.ids[self.block_start:length]
            self.restore_snapshot()
            self.cache.crop(-(len(self.ids) - start))
            del self.ids[start:]
            self.settled = True  # that crop trimmed the convolution windows
            if kept:  # a new block from the same start state: a later cut inside it rolls back again
                self.run(kept, hidden=False, last_only=True)

    def full_attention_only(self) -> bool:
        """No sliding window (trimmed to its window once settled) and no recurrent state in any layer."""
        return not self.has_recurrent and not any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)

    def recompute(self, length: int) -> None:
        kept = self.ids[:length]
        self.reset()
        self.recomputes += 1
        if kept:
            self.run(kept, hidden=False, last_only=True)

    def reset(self) -> None:
        self.cache, self.ids, self.block_start, self.snapshot, self.settled = self.new_cache(), [], 0, None, True

    def synchronize(self) -> None:
        synchronize(self.device)

    def fork(self) -> "HFTarget":
        return HFTarget(self.model, self.config, self.device, self.dtype, self.layer_ids, self.max_context, [],
                        self.capture)
