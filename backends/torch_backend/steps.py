"""Steps of fixed shape: the target's decode and verify steps and a draft's block and context catch-up as functions of
device tensors alone (token ids, RoPE positions, cache slots), over K/V caches allocated whole on CUDA where they
fit (else grown by doubling: layers.first_allocation), with row counts rounded up to a few buckets (a prompt in
chunks of up to 128 rows) and the attended slots up to a power of two (a tier). No value of a step is read back by
the host inside it, so on CUDA each (kind, rows, tier) is captured once as a CUDA graph and replayed: one launch
where an eager batch-1 step launches a few hundred small kernels, each waiting on the host (launch-bound on a GPU).

Why a padded bucket is lossless: padding rows sit after the real rows; the target's causal mask keeps them out
of every real row's keys, and what they write to the cache lies at positions past the real rows', which the next
real tokens overwrite before any row can see them (a key at position p is visible only to rows at p or later).
A draft's block attends to the context and its own rows only (slots up to its last row), so a catch-up's padding
slots are either overwritten by the block or stay out of its mask.

Attention runs over the tier's slots with a mask instead of over the used prefix: the same keys, weight zero on
the others, so the outputs equal the eager step's to float rounding (tests hold tokens identical and logits
within 1e-5 in float32)."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
import torch.fx.experimental._config  # noqa: F401  (symbolic shapes' settings: `compiled`)

from hetero_sd.backends.base import CAPTURE
from hetero_sd.errors import DeviceFailedError

from .layers import KVCache, Rope, TorchOps, rms_norm

BUCKETS = (1, 2, 4, 8, 16)  # row counts a step is captured for: decode, verify-k, a draft's catch-up
# A prompt's rows go through the target in chunks of these (the last one padded up): eager, a prefill is as many
# launches as a decode step whatever its length (~20 ms for the 135M default on an H200 VM, all of it before the
# first token), captured one launch a chunk
PREFILL = (32, 64, 128)
# Slots past a model's context that a padded step may write (a prompt's last chunk padded up to its bucket; a
# verify's padding, a draft's block and a catch-up's padding are fewer): a cache for fixed steps holds them, so that
# a step near the context's end does not grow a cache allocated whole (which would drop every captured step)
PAST = PREFILL[-1]
MODES = ("auto", "eager", "fixed", "graphs", "compiled")


def bucket(rows: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket that holds `rows`, None past the largest (the caller then runs eagerly)."""
    return next((b for b in buckets if b >= rows), None)


def steps_mode(asked: str, device: str, torch_ops: bool, torch_matmuls: bool = True) -> tuple[str, str | None]:
    """How a model's steps run: 'graphs' (fixed shapes captured as CUDA graphs), 'compiled' (fixed shapes under
    torch.compile: inductor's fused kernels, captured as CUDA graphs on CUDA), 'fixed' (fixed shapes, run
    eagerly) or 'eager' (today's shapes), and a note where what was asked cannot run here. 'auto': graphs on
    CUDA, eager elsewhere (on a CPU the fused C++ ops are the fast path; fixed shapes would only add the masked
    keys' work). The fixed steps need the torch ops strategy: the fused C++ ops take a start, not positions;
    compiled steps need torch's matmuls too (torch.compile does not trace the native CPU matmul kernels)."""
    if asked not in MODES:
        raise ValueError(f"steps={asked!r} is not a step mode; use one of {', '.join(MODES)}")
    cuda = torch.device(device).type == "cuda"
    wanted = ("graphs" if cuda else "eager") if asked == "auto" else asked
    if wanted == "eager":
        return "eager", None
    if not torch_ops:
        return "eager", f"{wanted} steps need the torch ops strategy; this model runs fused C++ ops: eager steps"
    if wanted == "graphs" and not cuda:
        return "fixed", f"CUDA graphs need a CUDA device, not {device}: fixed-shape steps run eagerly"
    if wanted == "compiled" and not torch_matmuls:
        return ("graphs" if cuda else "fixed"), ("compiled steps need torch's matmuls; this model multiplies by "
                                                 "native CPU kernels (GGUF blocks or the packed float32 GEMM): "
                                                 "its steps run uncompiled")
    return wanted, None


def mode_names(mode: str, device: str) -> list[str]:
    """How a step mode is named in a model's mode string (the stats and the cost cache's key)."""
    captured = " + CUDA graphs" if torch.device(device).type == "cuda" else ""
    return {"graphs": ["CUDA graphs"], "compiled": [f"torch.compile{captured}"], "fixed": ["fixed-shape steps"],
            "eager": []}[mode]


COMPILING = threading.RLock()
RECOMPILES = 32  # Dynamo's compilations of one step function, all models in a process (each takes <= 6)


def compiled(step: Callable, name: str) -> Callable:
    """`step` under torch.compile: inductor fuses its elementwise ops (norms, RoPE, the gate) into a few kernels,
    where eagerly each op is a kernel of its own, and on CUDA the Runner then captures those kernels like any
    step's. fullgraph: a graph break would run part of a step eagerly, unannounced. Shapes are symbolic from the
    start (the weights' stay static): one compilation serves every bucket and tier, and a function takes a few in
    all (one row or more, a tier that is the whole allocation or not, a branch on the rows), shared by every model
    of its shapes (caches and inputs are read at each call, from its arguments or the step's object).
    Past RECOMPILES the error is raised, not Dynamo's silent eager fallback. Without duck shapes: a row count that
    equals a cache's dimension (8 rows, 8 KV heads) stays a symbol of its own, not a guard and a compilation more.
    One compiled call at a time in a process (COMPILING): before torch 2.12 Dynamo's config is the process's, and
    two lanes' patches (a CPU draft's beside a GPU target's) would undo each other mid-compilation. On CUDA every
    compiled call is a capture's, one at a time already."""
    fn = torch.compile(step, fullgraph=True, dynamic=True)
    config, shapes = torch._dynamo.config, torch.fx.experimental._config
    # (the first name of each that this torch has: the older names are aliases where both exist)
    limits = {next((k for k in names if hasattr(config, k)), None): value
              for names, value in ((("recompile_limit", "cache_size_limit"), RECOMPILES),
                                   (("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True))}
    limits.pop(None, None)
    ducks = {"use_duck_shape": False} if hasattr(shapes, "use_duck_shape") else {}
    failures = tuple(e for e in (getattr(torch._dynamo.exc, n, None) for n in
                                 ("TorchDynamoException", "FailOnRecompileLimitHit")) if e is not None)

    def run(*args):
        with COMPILING, config.patch(**limits), shapes.patch(**ducks):
            try:
                return fn(*args)
            except failures as e:  # (a device's own error, out of memory, is raised as it is)
                raise DeviceFailedError(f"torch.compile of the {name} step failed "
                                        f"({type(e).__name__}: {' '.join(str(e).split())[:300]})",
                                        "HETERO_SD_STEPS=graphs (or fixed) runs the steps uncompiled") from e
    return run


FIX = "HETERO_SD_STEPS=fixed (or eager) runs the steps without capturing them"
# Why no capture is tried again in a process after one failed: torch before 2.12 leaves its allocator believing a
# capture is under way when cudaStreamEndCapture fails (pytorch#180395), and every later torch.cuda.graph, which
# empties the cache on entry, then fails on an internal assert that would hide the first, real error.
failed_capture: list[str] = []


class Runner:
    """Runs a step function over static inputs: as it is ('fixed'), or captured once per key as a CUDA graph and
    replayed ('graphs'). A capture's warm-up runs the step on its real inputs: a step is idempotent (it writes
    the same K/V at the same slots), so warming up, capturing and replaying leave the caches as one run would.
    Outputs of a graph live in its pool and are overwritten by its next replay: callers copy what they keep."""

    def __init__(self, mode: str, device: str):
        self.mode, self.device = mode, torch.device(device)
        # what is captured: every fixed step on CUDA, compiled (inductor's kernels) or not
        self.capturing = mode == "graphs" or (mode == "compiled" and self.device.type == "cuda")
        self.graphs: dict = {}
        self.pool = None
        self.captures = 0

    def reset(self) -> None:
        """Forget the captured steps (their inputs moved: a grown cache) and their memory pool: a pool whose
        graphs are all gone is not captured into again (cuBLAS keeps its workspace in the first one). Not while
        another thread captures: CUDA refuses to destroy a graph during a capture."""
        with CAPTURE:
            self.graphs = {}
            self.pool = None

    def run(self, key, fn: Callable[[], tuple]) -> tuple:
        if not self.capturing:
            return fn()
        if key not in self.graphs:
            self.graphs[key] = self.capture(fn)
        graph, outputs = self.graphs[key]
        with torch.cuda.device(self.device):  # replayed on the current stream of the model's device
            graph.replay()
        return outputs

    def capture(self, fn):
        # one capture at a time in a process (torch's rule: they share its capture stream); a target and a
        # draft on two lanes may both meet a new shape at once
        with CAPTURE, torch.cuda.device(self.device):
            if failed_capture:
                raise DeviceFailedError(f"no step is captured as a CUDA graph in this process after a capture "
                                        f"failed ({failed_capture[0]})", FIX)
            return self.capture_here(fn)

    def capture_here(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS workspaces, lazy inits)
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph, before = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        try:
            # thread_local: the other lane (a CPU draft copying features off this GPU) may call CUDA meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = fn()
        except Exception as e:
            torch.cuda.set_stream(before)  # a failed capture_end leaves the capture stream current
            failed_capture.append(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")  # (CUDA's run over lines)
            raise DeviceFailedError(f"capturing a step as a CUDA graph failed on {self.device} ({failed_capture[-1]})",
                                    FIX) from e
        self.pool = graph.pool()  # every bucket's graph shares one memory pool
        self.captures += 1
        return graph, outputs


class FixedOps(TorchOps):
    """TorchOps whose K/V go to the cache at the slots of a positions tensor (index_copy_) and whose attention
    reads the cache's first slots under the step's mask (as many as the mask has columns: the step's tier)."""

    def attention(self, layer, x, cache: KVCache, i: int, positions, cos, sin, mask):
        return attend_slots(layer, x, cache.k[i], cache.v[i], positions, cos, sin, mask)


def attend_slots(layer, x, keys: torch.Tensor, values: torch.Tensor, positions, cos, sin, mask):
    """The normed rows x's q|k|v, their K/V written to a layer's cache at the slots `positions`, and attention over
    the tier's first slots under the step's mask, through o_proj."""
    q, k, v = layer.project_qkv(x, cos, sin)
    keys.index_copy_(2, positions, k)
    values.index_copy_(2, positions, v)
    tier = mask.shape[-1]
    return layer.attention(q, keys[:, :, :tier], values[:, :, :tier], mask)


class CompiledOps(FixedOps):
    """FixedOps whose whole layer (both halves, their residual adds and the next layer's norm) is one compiled
    function, its weights among its arguments: every layer of a model shares its compilations, which cost a layer's
    tracing, not the model's depth (compiling a whole step traces every layer again). The embedding, masks, final
    norm and head around the layers stay eager ops in the step (captured with it on CUDA)."""

    def __init__(self, eps: float):
        super().__init__(eps)
        self.compiled = compiled(self.whole_layer, "target's layer")

    def whole_layer(self, layer, post_norm, next_norm, h, x, keys, values, positions, cos, sin, mask):
        h, x = self.add_norm(h, attend_slots(layer, x, keys, values, positions, cos, sin, mask), post_norm)
        return self.add_norm(h, layer.mlp(x), next_norm)

    def layer(self, layer, post_norm, next_norm, h, x, cache: KVCache, i: int, positions, cos, sin, mask):
        return self.compiled(layer, post_norm, next_norm, h, x, cache.k[i], cache.v[i], positions, cos, sin, mask)


def tiers(positions: int) -> list[int]:
    """The tiers a context of up to `positions` slots attends over: 256, then each doubling up to one that holds it."""
    out = [256]
    while out[-1] < positions:
        out.append(2 * out[-1])
    return out


def tier(need: int, allocated: int) -> int:
    """How many cache slots a step attends over: a power of two that holds `need` (256 at least), within the
    allocation. Attention reads every slot it is given, so a step on a short context must not pay for the whole
    context limit; one capture per (rows, tier) keeps shapes fixed."""
    return min(allocated, max(256, 1 << (need - 1).bit_length()))


class Slots:
    """A cache's slots as the fixed steps see them: its allocation (grown by doubling, as the eager steps grow
    it), the RoPE tables over it and the slot numbers. A grown cache is new memory, so the captured steps that
    read the old one are dropped and captured again."""

    def __init__(self, cache: KVCache, rope: Rope, runner: Runner):
        self.cache, self.rope, self.runner = cache, rope, runner
        self.cos = self.sin = self.keys = None
        self.memory = None

    def warm_tiers(self, need: int | None) -> list[int]:
        """The tiers of steps whose slots reach up to `need` (None: as many as the cache holds now), the cache
        reserved for them first (as a run that far would: a cache grown between two warm steps would drop the first
        one's capture). None grows nothing: past the allocation a cache grows, and its steps are captured anew then."""
        if need is not None:
            self.cache.reserve(need)
        allocated = self.cache.k[0].shape[2]
        return sorted({tier(t, allocated) for t in tiers(allocated if need is None else need)})

    def prepare(self, need: int, rope_need: int) -> int:
        """Room for slots [0, need) and RoPE positions [0, rope_need); returns the step's tier."""
        self.cache.reserve(need)
        allocated = self.cache.k[0].shape[2]
        if self.memory != self.cache.k[0].data_ptr() or self.cos.shape[0] < rope_need:
            self.cos, self.sin = self.rope.at(0, max(allocated, rope_need))  # views the graphs keep alive
            self.keys = torch.arange(allocated, device=self.cache.device)
            self.memory = self.cache.k[0].data_ptr()
            self.runner.reset()
        return tier(need, allocated)


def host_rows(shape: tuple, device: torch.device) -> torch.Tensor:
    """A host buffer for a step's inputs: pinned for a CUDA device, so the copy is asynchronous (the caching host
    allocator hands the block out again only once the copy that read it has run), pageable elsewhere."""
    return torch.empty(shape, dtype=torch.long, pin_memory=device.type == "cuda")


def to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    dst.copy_(host, non_blocking=host.is_pinned())


class TargetSteps:
    """A torch target's decode and verify steps at fixed shapes, head and context features included. `inputs`
    row 0: the token ids, row 1: their positions (= cache slots), written from the host in one copy a step."""

    def __init__(self, model, cache: KVCache, rope: Rope, capture: frozenset, gather, mode: str):
        self.model, self.cache, self.capture, self.gather = model, cache, capture, gather
        self.inputs = torch.zeros(2, PREFILL[-1], dtype=torch.long, device=cache.device)
        self.ops = (CompiledOps if mode == "compiled" else FixedOps)(model.config.rms_norm_eps)
        self.runner = Runner(mode, cache.device)
        self.slots = Slots(cache, rope, self.runner)

    def __call__(self, token_ids: Sequence[int], start: int, tail: torch.Tensor | None = None,
                 last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(float32 logits [count, vocab] (or the last row's), context features [count, L*H] or None, each row's
        argmax or None) of up to PREFILL[-1] rows at positions start..: the features a copy, safe to keep past the
        next step (the draft takes them after plain steps); the logits and the argmax the step's own memory, valid
        until the next (TargetOutput: each is used at once; a copy of a verify's logits was a launch and up to
        16 x vocab floats a step). `tail`:
        ids after token_ids that are already on a device (a drafted block's argmax), copied into the inputs there,
        never read by the host."""
        head = len(token_ids)
        count = head + (0 if tail is None else tail.shape[0])
        rows = bucket(count, BUCKETS + PREFILL)
        t = self.slots.prepare(start + rows, start + rows)
        host = host_rows((2, rows), self.inputs.device)
        host[0, :head] = torch.as_tensor(list(token_ids))
        host[0, head:] = host[0, head - 1]  # padding (and the tail's place until it is written): any valid id
        host[1] = torch.arange(start, start + rows)
        on_host = tail is not None and tail.device.type == "cpu"
        if on_host:
            host[0, head:count] = tail
        to_device(self.inputs[:, :rows], host)
        if tail is not None and not on_host:
            self.inputs[0, head:count].copy_(tail)  # device to device, in stream order after the host's copy
        out, features, top = self.runner.run((rows, t), lambda: self.step(rows, t))
        kept = slice(count - 1, count) if last_only else slice(0, count)
        # a prefill chunk's graph ends at the final norm: the head runs here on the rows asked for (a prompt's last)
        logits = self.model.logits(out[kept]) if rows > BUCKETS[-1] else out[kept]
        return logits, None if features is None else features[:count].clone(), None if top is None else top[kept]

    def warm(self, positions: int | None) -> int:
        """Every (rows, tier) a context of up to `positions` slots can meet (None: of the cache as allocated), run
        once past the cache's length: a step whose last row fills its tier. What it writes there is overwritten
        before any row can see it (as a padded bucket's rows are)."""
        length, ran = self.cache.length, 0
        # (a verify at the end pads up to 16 rows)
        for t in self.slots.warm_tiers(None if positions is None else positions + BUCKETS[-1]):
            for rows in BUCKETS + PREFILL:
                if length + rows <= t:
                    self([0] * rows, t - rows, last_only=True)
                    ran += 1
        self.cache.length = length
        return ran

    def prefill(self, token_ids: Sequence[int], start: int, last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt of any length in chunks of PREFILL[-1] rows: (the logits of every row, or the last one, and the
        context features of every row)."""
        logits, features = [], []
        for at in range(0, len(token_ids), PREFILL[-1]):
            chunk = token_ids[at:at + PREFILL[-1]]
            out, captured, _ = self(chunk, start + at, last_only=last_only)
            logits.append(out)
            features.append(captured)
        logits = logits[-1] if last_only else torch.cat(logits)
        return logits, None if features[0] is None else torch.cat(features)

    def step(self, rows: int, t: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        ids, positions, s = self.inputs[0:1, :rows], self.inputs[1, :rows], self.slots
        mask = s.keys[None, :t] <= positions[:, None]  # causal over the tier's slots: [rows, t]
        normed, captured = self.model(ids, self.cache, positions, s.cos[positions], s.sin[positions], mask,
                                      self.capture, ops=self.ops)
        # Past the verify buckets (a prompt's chunks) the normed hidden states, not logits: a captured output lives
        # as long as its graph, and 128 rows of float32 logits over a 151,936-word vocabulary are 78 MB a tier
        if rows > BUCKETS[-1]:
            return normed[0], self.gather(captured), None
        logits = self.model.logits(normed[0])
        return logits, self.gather(captured), logits.argmax(-1)  # (a greedy step's token: inside the graph)


class DraftSteps:
    """A plain DFlash draft's block and context catch-up at fixed shapes (DFlash2 and drafts with masked
    attention layers run eagerly). `inputs` rows: 0 the block's ids, 1 its RoPE positions, 2 its cache slots
    (after the context: slots and positions differ for a pre-drafted block on a lagged context)."""

    def __init__(self, model, cache: KVCache, rope: Rope, feature_size: int, block_size: int, mode: str,
                 rows_of: Callable[[int], int]):
        self.model, self.cache, self.block_size, self.rows_of = model, cache, block_size, rows_of
        self.inputs = torch.zeros(3, max(BUCKETS[-1], block_size), dtype=torch.long, device=cache.device)
        self.features = torch.zeros(BUCKETS[-1], feature_size, dtype=model.fc.dtype, device=cache.device)
        self.runner = Runner(mode, cache.device)
        self.slots = Slots(cache, rope, self.runner)
        if mode == "compiled":
            self.block_step = compiled(self.block_step, "draft's block")
            self.context_step = compiled(self.context_step, "draft's context")

    def block(self, anchor: int, mask_token: int, position: int, start: int, rows: int,
              size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The final-normed hidden states [size-1, H] of the block [anchor, mask, ...] of `rows` rows and their
        float32 logits through the draft's head, its anchor at RoPE `position` and in cache slot `start` (copies)."""
        t = self.slots.prepare(start + rows, position + rows)
        host = host_rows((3, rows), self.inputs.device)
        host[0] = mask_token
        host[0, 0] = anchor
        host[1] = torch.arange(position, position + rows)
        host[2] = torch.arange(start, start + rows)
        to_device(self.inputs[:, :rows], host)
        hidden, logits = self.runner.run(("block", rows, size, t), lambda: self.block_step(rows, size, t))
        return hidden.clone(), logits.clone()

    def block_step(self, rows: int, size: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, eps, s = self.model, self.model.arch.rms_norm_eps, self.slots
        ids, positions, slots = self.inputs[0:1, :rows], self.inputs[1, :rows], self.inputs[2, :rows]
        mask = (s.keys[:t] <= slots[-1])[None, :].expand(rows, -1)  # the context and the block, non-causal

        def write(i, k, v):
            self.cache.k[i].index_copy_(2, slots, k)
            self.cache.v[i].index_copy_(2, slots, v)
            return self.cache.k[i][:, :, :t], self.cache.v[i][:, :, :t]

        h = m(m.embed_block(ids), s.cos[positions], s.sin[positions], write, [mask] * len(m.layers))
        hidden = rms_norm(h[0, 1:size], m.norm, eps)
        return hidden, m.head(hidden)

    def warm(self, positions: int | None, mask_token: int) -> int:
        """Every block size (2..the draft's block) at each tier, and every catch-up bucket, run once past the
        context's length (what they write there is overwritten before a block sees it: the catch-up writes a
        position before any block attends to it). None: the tiers of the cache as allocated."""
        length, ran = self.cache.length, 0
        past = max(BUCKETS[-1], self.rows_of(self.block_size))
        for t in self.slots.warm_tiers(None if positions is None else positions + past):
            for size in range(2, self.block_size + 1):
                rows = self.rows_of(size)
                if length + rows <= t:
                    self.block(0, mask_token, t - rows, t - rows, rows, size)
                    ran += 1
        allocated = self.cache.k[0].shape[2]
        for rows in BUCKETS:
            if positions is not None or length + rows <= allocated:  # (None grows no cache)
                self.context(torch.zeros(rows, self.features.shape[1], device=self.features.device), length)
                ran += 1
        return ran

    def context(self, features: torch.Tensor, start: int) -> None:
        """Context features [T, L*H] (T up to the largest bucket) to every layer's K/V at slots start.."""
        count = features.shape[0]
        rows = bucket(count)
        self.slots.prepare(start + rows, start + rows)
        self.features[:count].copy_(features.to(self.features.dtype))
        host = host_rows((rows,), self.inputs.device)
        host[:] = torch.arange(start, start + rows)
        to_device(self.inputs[2, :rows], host)
        self.runner.run(("context", rows), lambda: self.context_step(rows))

    def context_step(self, rows: int) -> tuple:
        m, slots = self.model, self.inputs[2, :rows]
        fused = m.fuse(self.features[:rows])
        cos, sin = self.slots.cos[slots], self.slots.sin[slots]
        for i in range(len(m.layers)):
            k, v = m.context_kv(fused, cos, sin, i)
            self.cache.k[i].index_copy_(2, slots, k)
            self.cache.v[i].index_copy_(2, slots, v)
        return ()
