"""The MLX target's decode/verify steps and the draft's block and context catch-up under `mx.compile`, at fixed
shapes: rows rounded up to a bucket, the cache read as a tier of slots (torch_backend/steps.py's buckets and
tiers). Each compiled function is pure: it reads the cache and returns the new rows' K/V, which the caller then
writes in place with a slice update as the eager steps do, so a compiled trace is reused at every position
(the context's length is an array and the rows' RoPE values are inputs: nothing a position changes is traced).
A model's forks share its compiled functions: they read the shared weights and take the caches as arguments.

Masks: the cache's slots from `start` on are hidden (-1e9, as the eager steps' causal mask does) and the new
rows see one another causally (target) or all at once (the draft's block), so padding rows after the real ones
change nothing the real rows compute, and only the real rows' K/V are written."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from hetero_sd.backends.torch_backend.steps import BUCKETS, bucket, tier, tiers

from .layers import rms_norm

HIDDEN = -1e9  # an additive mask's hidden entry (the eager steps' value)


def steps_mode(asked: str) -> tuple[str, str | None]:
    """'compiled' or 'eager' for an MLX model, and a note where the choice is not what was asked. 'auto' compiles
    on Metal (a GPU, where dispatch per op is dear) and stays eager on MLX's CPU build."""
    if asked == "eager":
        return "eager", None
    if asked == "auto":
        return ("compiled" if mx.metal.is_available() else "eager"), None
    return "compiled", None  # 'fixed' and 'graphs': mx.compile is MLX's capture


def padded(ids: Sequence[int], rows: int) -> mx.array:
    ids = list(ids)
    return mx.array([ids + [ids[-1]] * (rows - len(ids))])


def cache_mask(start: mx.array, slots: int, rows: int, block: mx.array, dtype) -> mx.array:
    """[rows, slots + rows]: the cache's slots before `start`, then the new rows as `block` ([rows, rows] bool)."""
    cached = mx.broadcast_to((mx.arange(slots) < start)[None, :], (rows, slots))
    return mx.where(mx.concatenate([cached, block], 1), 0.0, HIDDEN).astype(dtype)


def ensure(cache, like_heads: int, head_dim: int, need: int, dtype) -> int:
    """Room for `need` slots in every layer; the tier of slots a step reads."""
    for i in range(cache.num_layers):
        if cache.k[i] is None or cache.k[i].shape[2] < need:
            cache.grow(i, cache.length, need, mx.zeros((1, like_heads, 1, head_dim), dtype))
    return tier(need, cache.k[0].shape[2])


def warm_tiers(cache, like_heads: int, head_dim: int, need: int | None, dtype) -> list[int]:
    """The tiers of steps whose slots reach up to `need`, the cache grown to hold them first (a cache grown between
    two warm steps would change the tiers: they are capped by the allocation). None: the cache as allocated, or its
    first STEP of slots where nothing is yet (where every context starts; past it, shapes compile on first use)."""
    allocated = None if cache.k[0] is None else cache.k[0].shape[2]
    ensure(cache, like_heads, head_dim, (allocated or cache.STEP) if need is None else need, dtype)
    allocated = cache.k[0].shape[2]
    return sorted({tier(t, allocated) for t in tiers(allocated)})


class TargetSteps:
    def __init__(self, target, fns: dict | None = None):
        self.t = target
        self.fns: dict = {} if fns is None else fns  # (rows, slots) -> the compiled step

    def __call__(self, token_ids: Sequence[int], start: int, features: bool):
        t, count = self.t, len(token_ids)
        rows = bucket(count)
        c = t.config
        slots = ensure(t.cache, c.num_key_value_heads, c.head_dim, start + count, t.dtype)
        fn = self.fns.get((rows, slots))
        if fn is None:
            fn = self.fns[(rows, slots)] = mx.compile(self.step)
        ks = [k[:, :, :slots] for k in t.cache.k]
        vs = [v[:, :, :slots] for v in t.cache.v]
        cos, sin = t.rope.at(start, rows)  # the rows' own: a whole table's shape grows (and would trace anew)
        logits, feats, *kv = fn(padded(token_ids, rows), mx.array(start), cos, sin, *ks, *vs)
        n = len(t.layers)
        for i in range(n):
            t.cache.write(i, start, kv[i][:, :, :count], kv[n + i][:, :, :count])
        return logits[:count], (feats[:count] if features and t.layer_ids else None)

    def step(self, ids, start, cos, sin, *kv):
        t, c = self.t, self.t.config
        n, rows = len(t.layers), ids.shape[1]
        causal = mx.arange(rows)[None, :] <= mx.arange(rows)[:, None]
        mask = cache_mask(start, kv[0].shape[2], rows, causal, t.dtype)
        h, captured, new_k, new_v = t.embed[ids], [], [], []
        for i, layer in enumerate(t.layers):
            q, k, v = layer.project(rms_norm(h, layer.in_norm, c.rms_norm_eps), cos, sin)
            new_k.append(k)
            new_v.append(v)
            h = layer.attend(h, q, mx.concatenate([kv[i], k], 2), mx.concatenate([kv[n + i], v], 2), mask)
            if i in t.layer_ids:
                captured.append(h)
        logits = rms_norm(h[0], t.norm, c.rms_norm_eps) @ t.lm_head
        feats = t.gather(captured) if t.layer_ids else mx.zeros((rows, 1), t.dtype)
        return (logits, feats, *new_k, *new_v)

    def warm(self, positions: int | None) -> int:
        """Every (rows, tier) a context of up to `positions` slots can meet, run once past the cache's length (what
        it writes there is overwritten before any row can see it, as a padded bucket's rows are), so that each is
        compiled now; how many ran."""
        t, c, ran = self.t, self.t.config, 0
        length = t.cache.length
        for slots in warm_tiers(t.cache, c.num_key_value_heads, c.head_dim,
                                None if positions is None else positions + BUCKETS[-1], t.dtype):
            for rows in BUCKETS:
                if length + rows <= slots:
                    mx.eval(*self([0] * rows, slots - rows, True)[:1], *t.cache.k, *t.cache.v)
                    ran += 1
        return ran


class DraftSteps:
    def __init__(self, draft, fns: dict | None = None):
        self.d = draft
        self.fns: dict = {} if fns is None else fns  # ("block", rows, size, slots) / ("context", rows) -> compiled

    def block(self, anchor: int, position: int, rows: int, size: int):
        """The block's final-normed hidden states [size-1, H] and its logits over the draft's head columns."""
        d, a = self.d, self.d.arch
        start = d.cache.length
        slots = ensure(d.cache, a.num_key_value_heads, a.head_dim, start + rows, d.dtype)
        key = ("block", rows, size, slots)
        fn = self.fns.get(key)
        if fn is None:
            fn = self.fns[key] = mx.compile(lambda *args: self.block_step(size, *args))
        ids = mx.array([[anchor] + [d.mask_token_id] * (rows - 1)])
        return fn(ids, mx.array(start), *d.rope.at(position, rows),
                  *[k[:, :, :slots] for k in d.cache.k], *[v[:, :, :slots] for v in d.cache.v])

    def block_step(self, size, ids, start, cos, sin, *kv):
        d, eps = self.d, self.d.arch.rms_norm_eps
        n, rows = len(d.layers), ids.shape[1]
        mask = cache_mask(start, kv[0].shape[2], rows, mx.ones((rows, rows), dtype=mx.bool_), d.dtype)
        h = d.embed[ids]
        for i, layer in enumerate(d.layers):
            q, k, v = layer.project(rms_norm(h, layer.in_norm, eps), cos, sin)
            h = layer.attend(h, q, mx.concatenate([kv[i], k], 2), mx.concatenate([kv[n + i], v], 2), mask)
        hidden = rms_norm(h[0, 1:size], d.norm, eps)
        return hidden, hidden @ d.lm_head

    def context(self, features: mx.array, start: int) -> None:
        """Context features [T, L*H] (a bucket's rows at most) to every layer's K/V at slots start.."""
        d, a, count = self.d, self.d.arch, features.shape[0]
        rows = bucket(count)
        ensure(d.cache, a.num_key_value_heads, a.head_dim, start + count, d.dtype)
        cos, sin = d.rope.at(start, rows)
        fn = self.fns.get(("context", rows))
        if fn is None:
            fn = self.fns[("context", rows)] = mx.compile(self.context_step)
        if rows > count:
            features = mx.concatenate([features, mx.zeros((rows - count, features.shape[1]), features.dtype)])
        kv = fn(features, cos, sin)
        n = len(d.layers)
        for i in range(n):
            d.cache.write(i, start, kv[i][:, :, :count], kv[n + i][:, :, :count])

    def warm(self, positions: int | None) -> int:
        """Every block size (2..the draft's block) at each tier, and every catch-up bucket, run once past the
        context's length (what the catch-up writes there is overwritten before a block attends to it); how many."""
        d, a, ran = self.d, self.d.arch, 0
        length = d.cache.length
        rows_of = [(size, d.format.block_rows(size, d.block_size)) for size in range(2, d.block_size + 1)]
        past = max(BUCKETS[-1], max(rows for _, rows in rows_of))
        try:
            for slots in warm_tiers(d.cache, a.num_key_value_heads, a.head_dim,
                                    None if positions is None else positions + past, d.dtype):
                for size, rows in rows_of:
                    if length + rows <= slots:
                        d.cache.length = slots - rows  # (the block reads the context's length: its tier's last)
                        mx.eval(*self.block(0, slots - rows, rows, size))
                        ran += 1
        finally:
            d.cache.length = length
        allocated = d.cache.k[0].shape[2]
        for rows in BUCKETS:
            if length + rows <= allocated:
                self.context(mx.zeros((rows, d.fc.shape[0]), d.dtype), length)
                mx.eval(*d.cache.k, *d.cache.v)
                ran += 1
        return ran

    def context_step(self, features, cos, sin):
        d = self.d
        fused = rms_norm(features[None] @ d.fc, d.hidden_norm, d.arch.rms_norm_eps)
        ks, vs = zip(*(layer.project(fused, cos, sin, queries=False) for layer in d.layers))
        return (*ks, *vs)
