"""The seam between decoding math and devices.

A target backend runs the frozen target over new tokens, appending to a KV cache it can crop, and
captures the hidden states the draft conditions on. A draft backend keeps the context features it has
been given and fills one block [anchor, mask, ...] per call. Everything returned is a torch tensor
(on whatever torch device the backend likes); the decoding loop never looks inside a backend."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from hetero_sd.models.config import ArchConfig
from hetero_sd.models.draft_format import DraftFormat


# ---- a DFlash2 block before its tokens are chosen, and how the acceptance rules see it ----
# A DFlash2 draft does not draft each position independently: its candidate selector walks the block in
# order, scoring the top-k candidates of each position given the token chosen at the position before
# (the anchor for the first). At temperature > 0 the walk samples, and the proposal q of position i is
# a distribution over that position's candidates given the tokens drafted before it. Written into the
# vocabulary with zeros elsewhere, it is an ordinary proposal distribution for `sampling.rejection`:
# accepting d_i with probability min(1, p(d_i) / q(d_i)) and resampling from max(p - q, 0) on a
# rejection keeps the target's distribution exactly, because each q_i is conditioned only on drafts
# that were accepted (they equal the emitted tokens). Off the candidates q is 0, so the residual there
# is p itself.

# walk(temperature, generator) -> (tokens, candidates [n, k], q over the candidates [n, k] or None at T=0)
Walk = Callable[[float, torch.Generator | None], tuple[list[int], torch.Tensor, torch.Tensor | None]]


@dataclass
class SelectorBlock:
    logits: torch.Tensor  # [n, vocab] float32: the draft's logits, the selector's unary scores
    walk: Walk

    def choose(self, sampler, rule: str) -> tuple[list[int], torch.Tensor | None]:
        """The drafted tokens, and q (dense over the vocabulary) when the rule needs it. Greedy decoding
        and the `match` rule take the selector's greedy walk (its most likely path, as argmax is for DFlash)."""
        if sampler.params.greedy or rule == "match":
            return self.walk(0.0, None)[0], None
        tokens, candidates, q = self.walk(sampler.params.temperature, sampler.generator(self.logits.device))
        return tokens, torch.zeros_like(self.logits).scatter(-1, candidates, q.float())


def uploaded(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`. Up to a GPU from pinned memory: queued like a kernel, where a copy from pageable memory
    makes the host wait for everything queued before it (a stall in the middle of a step)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def logits_of(block) -> torch.Tensor:
    """The per-position logits of a drafted block, whichever format drafted it."""
    return block.logits if isinstance(block, SelectorBlock) else block


@dataclass
class TargetOutput:
    # [T, vocab] float32: every new position, or only the last one. Used before the target's next step (sampled,
    # verified, its argmax read): a captured step hands out its own memory, which the next step writes again
    logits: torch.Tensor
    features: torch.Tensor | None  # [T, len(layer_ids) * hidden]: context features for the draft (kept: a copy)
    # [T] each row's argmax where the step computed it on the device with the logits (a captured step's: no launch
    # of its own). Its memory is the step's: valid until the target's next step, so it is read at once (a greedy
    # token, a verdict), never kept. None elsewhere
    argmax: torch.Tensor | None = None


class LayerWeights(Protocol):
    """One decoder layer's weights as [in, out] matrices: fused q|k|v (and k|v alone: the draft's
    projection of the context features), o, fused gate|up, down; its norms; biases and q/k norms where
    the model has them (else None)."""

    wqkv: torch.Tensor
    wkv: torch.Tensor
    bqkv: torch.Tensor | None
    bkv: torch.Tensor | None
    wo: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    nq: int  # width of q (heads * head_dim)
    nkv: int  # width of k and of v


@dataclass
class ModelWeights:
    """A model's weights as its backend holds them, for code outside the backend that reads them (the
    Neural Engine graph and its host, the bandwidth floor, step-cost floors). The draft's embedding and
    head are the target's."""

    config: ArchConfig
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [hidden, vocab]
    norm: torch.Tensor
    layers: Sequence[LayerWeights]
    kv_bytes_per_position: int
    rope: object  # RoPE tables: rope.at(start, count) -> (cos, sin)
    fc: torch.Tensor | None = None  # the draft's: context features -> hidden, [features, hidden]
    hidden_norm: torch.Tensor | None = None  # the draft's norm of the fused features
    format: DraftFormat | None = None  # the draft's format (DFlash, DFlash2, ...)
    read_bytes: int | None = None  # weight bytes a decode step reads, where not the tensors' own size
    #                                (a target multiplying GGUF blocks reads those, not its float32 copy)
    draft_vocab: torch.Tensor | None = None  # a reduced draft head: the target ids of lm_head's K columns
    peak: Callable[[], tuple[Callable[[], object], float] | None] | None = None  # -> (a product, its multiply-add
    #   ops) whose best time gives the peak of the kernel that multiplies these weights, where it is not a dense
    #   matmul of their dtype (int8 rows x GGUF blocks); None: the dense matmul's peak applies


def gather_features(layer_ids: list[int], captured: list, num_layers: int, final_norm, concat):
    """The draft's context features [T, L*H] from the hidden states captured in one forward (None where the
    target serves no draft): `feature_parts` joined by the backend's `concat(parts, axis)`."""
    if not layer_ids:
        return None
    return concat(feature_parts(layer_ids, captured, num_layers, final_norm), -1)[0]


def feature_parts(layer_ids: list[int], captured: list, num_layers: int, final_norm) -> list:
    """Captured hidden states (in layer order) arranged as in `layer_ids`, the last layer's after the
    final norm as in HF's hidden_states: the context features a DFlash draft was trained on."""
    by_layer = dict(zip(sorted(set(layer_ids)), captured))
    return [final_norm(by_layer[i]) if i == num_layers - 1 else by_layer[i] for i in layer_ids]


class TargetBackend(ABC):
    config: ArchConfig
    device: str
    layer_ids: list[int]  # target layers whose outputs are captured as context features
    max_context: int

    @property
    @abstractmethod
    def length(self) -> int:
        """Positions held in the KV cache."""

    @abstractmethod
    def forward(self, token_ids: Sequence[int], *, last_only: bool = False,
                features: bool = True) -> TargetOutput:
        """Run the tokens at positions length..length+T-1 and append them to the cache."""

    def forward_block(self, anchor: int, drafted: torch.Tensor) -> TargetOutput:
        """Verify [anchor] + drafted, the drafted ids a 1-D tensor on the draft's device (its argmax, which the host
        has not read). This default reads them (a device sync); a backend that writes them into its step's inputs
        on the device overrides it, so that a step with its acceptance on the device reads the device once."""
        return self.forward([anchor] + drafted.tolist())

    @abstractmethod
    def crop(self, length: int) -> None:
        """Forget every position from `length` on (rejected drafts)."""

    def synchronize(self) -> None:
        """Wait for queued device work; the lanes call it at the end of every job, so that a span on an
        asynchronous device (CUDA, MPS) ends when its kernels do, not when they were launched."""

    def warm(self, positions: int | None) -> int:
        """Run now every step shape a context of up to `positions` can meet (None: of as many positions as the cache
        holds now, which grows no cache; MLX, which allocates as it goes, takes its first slots), where a shape costs
        something on its first use (a CUDA graph's capture, a compilation), leaving the cache's content as it is;
        how many steps ran."""
        return 0

    def fork(self) -> "TargetBackend":
        """Another instance over the same weights with its own empty cache (two requests at once)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve two requests at once")

    def weights(self) -> ModelWeights:
        """The weights, for readers outside the backend (floors)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights")


class DraftBackend(ABC):
    block_size: int
    mask_token_id: int
    device: str
    last_hidden: torch.Tensor | None = None  # the last block's final hidden states [B-1, hidden], if kept

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Positions of context features held; the next anchor sits at this position."""

    @abstractmethod
    def add_context(self, features: torch.Tensor) -> None:
        """Append context features [T, L*H] for the next T positions."""

    @abstractmethod
    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        """Fill [anchor, mask * (B-1)] in one pass: float32 logits [B-1, vocab] for block positions 1...
        (a DFlash2 draft returns a SelectorBlock: those logits and its selector's walk.)
        The anchor sits at `position` (default: right after the context). A later position drafts on a
        lagged context, for pre-drafting while the positions in between are still being verified.
        `size` (default block_size) may be smaller: fewer mask positions, for the block-size controller."""

    @abstractmethod
    def crop(self, length: int) -> None:
        """Forget context from position `length` on."""

    def synchronize(self) -> None:
        """As for the target: wait for queued device work (called by the lanes after every job)."""

    def warm(self, positions: int | None) -> int:
        """As for the target: every block and catch-up shape up to `positions` (None: what the cache holds), run now;
        how many steps ran."""
        return 0

    def fork(self) -> "DraftBackend":
        """Another instance over the same weights with its own empty context."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve two requests at once")

    def weights(self) -> ModelWeights:
        """The weights, for readers outside the backend (the Neural Engine graph and its host, floors)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights")


class WrappedDraft(DraftBackend):
    """A draft around another: its context, caches and device work are the inner draft's; a subclass changes
    what `propose` returns (a benchmark's oracle, a test's faulty or adversarial draft)."""

    def __init__(self, inner: DraftBackend):
        self.inner = inner
        self.block_size, self.mask_token_id, self.device = inner.block_size, inner.mask_token_id, inner.device

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    def add_context(self, features: torch.Tensor) -> None:
        self.inner.add_context(features)

    def crop(self, length: int) -> None:
        self.inner.crop(length)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def warm(self, positions: int | None) -> int:
        return self.inner.warm(positions)

    def propose(self, anchor: int, position: int | None = None, size: int | None = None):
        return self.inner.propose(anchor, position, size)


# One CUDA graph capture at a time in a process, and no device-wide wait while one runs: CUDA refuses a
# cudaDeviceSynchronize while any stream captures, whatever the capture's mode, and both the wait and the capture
# fail (the capture on another lane's thread: a verify captured while a pre-draft waits on the same GPU). Re-entrant:
# nothing waits inside a capture on its own thread, and a wait there must not deadlock before CUDA refuses it.
CAPTURE = threading.RLock()


def synchronize(device: str) -> None:
    """Wait until the device has run what was queued on it (CUDA, MPS); nothing elsewhere."""
    if device.startswith("cuda"):
        with CAPTURE:
            torch.cuda.synchronize(torch.device(device))
    elif device.startswith("mps"):
        torch.mps.synchronize()


def thread_release(device: str) -> Callable[[], None] | None:
    """What a thread that ran `device`'s work runs before it ends, or None. MLX keeps streams per thread, and a thread
    that ends holding them can abort the process as it exits (MLX 0.32's CPU build: "terminate called without an
    active exception" after most runs of compiled steps on a lane's thread); mx.clear_streams ends them first."""
    if device != "mlx":
        return None
    import mlx.core as mx

    return getattr(mx, "clear_streams", None)  # (older MLX keeps one stream per device: nothing per thread)


def forward_matrices(lm_head, layers) -> list:
    """The matrices a forward multiplies by: the head and each layer's (LayerWeights' names), torch or MLX arrays
    (the cost floors count their bytes and parameters)."""
    return [lm_head] + [m for layer in layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]


def weights_of(backend) -> ModelWeights | None:
    """The backend's declared weights, or None for a backend that does not expose them."""
    try:
        return backend.weights()
    except NotImplementedError:
        return None
