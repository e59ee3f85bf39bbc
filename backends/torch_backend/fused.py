"""The target's layer as a few C++ calls instead of ~50 torch ops: RMSNorm (with the residual add before it),
RoPE on q and k with the K/V cache write, the attention over the cache, and SwiGLU's silu(gate) * up; and, where
every matrix is GGUF blocks, all the layers in one call (`layers`).

Why: once the decode step's matrices are GGUF blocks (quant.py, quant8.py), its weights take a few ms to read,
and the ~1,500 small torch ops of 30 layers took as long again (torch.profiler): each op costs a few
microseconds of dispatch whatever its size.

Numerics: the same float32 formulas as layers.py (HF Llama's RMSNorm: x * rsqrt(mean(x^2) + eps), then
times the weight; RoPE x*cos + rotate_half(x)*sin; silu(g) = g / (1 + exp(-g))), summed in a fixed order
per row: a row's result is the same alone or in any block of rows (decode and verify agree bit for bit,
which lossless decoding rests on), and within the parity tests' tolerance of torch's own ops.
Where the C++ attention runs, the K cache is tiled by 16 positions (key j's d-th value at
(j/16)*16*D + d*16 + j%16): a tile's scores are one chain of fmas per key over d, and a verify block's rows
share each tile from registers (verify-8/16 ~0.84x the rows layout's time on the 2-core Zen 5).
Used for float32 CPU targets (Llama-style like the embedded default; Qwen3's q/k norms are normed inside the
RoPE op, Qwen2's q|k|v bias added by the q|k|v product) and for a CPU draft's block, as the weight plan
decides (plan.py; LoadPolicy.fused=False opts out); a kernel that does not build is announced.
The C++ is kernels/fused.cpp (torch.ops.hetero_sd_fused: the layer walk), with fused_norm_rope.h, fused_attend.h
(and attend_q8.h) and fused_swiglu.h."""

from __future__ import annotations

import functools

import torch

from hetero_sd.backends.policy import LoadPolicy

from .cpu import cpu_flags  # noqa: F401  (the tests ask it which variants this CPU runs)
from .kernels import KernelUnavailable, ops
from .matmul import linear



class FusedOps:
    """torch.ops.hetero_sd_fused (kernels/fused.cpp) as the layer calls them: each op's default overload,
    bound once (a decode step makes ~360 of these calls)."""

    def __init__(self, ns):
        self.rms_norm, self.add_rms_norm = ns.rms_norm.default, ns.add_rms_norm.default
        self.layers = ns.layers.default
        self.attend, self.silu_mul, self.rope = ns.attend.default, ns.silu_mul.default, ns.rope_qkv.default
        self.rope_slots, self.attend_slots = ns.rope_slots.default, ns.attend_slots.default  # batched generation's rows
        self.has_attend = bool(ns.has_attend())

    def rope_qkv(self, qkv, cos, sin, kc, vc, start: int, nh: int, nkv: int, views: bool, norms=()) -> list:
        """q with RoPE (k with RoPE and v written to the caches), and with `views` the caches over [0, start+T).
        norms: (q_norm, k_norm, eps) for Qwen3-style layers (each head's row normed before RoPE)."""
        q = self.rope(qkv, cos, sin, kc, vc, start, nh, nkv, *norms)
        if not views:
            return [q]
        end = start + qkv.shape[1]
        return [q, kc.narrow(2, 0, end), vc.narrow(2, 0, end)]


@functools.lru_cache(maxsize=1)
def extension() -> FusedOps:
    """The compiled ops; KernelUnavailable with the reason (announced by the caller)."""
    return FusedOps(ops("fused"))


def fusable(cfg, device: str, dtype: torch.dtype, policy: LoadPolicy) -> tuple[bool, str | None]:
    """(whether a target's layers take these ops, the reason to announce when a float32 CPU target does not:
    other devices and dtypes, and the policy's own opt-out, need no note)."""
    if not policy.fused or device != "cpu" or dtype != torch.float32:
        return False, None
    try:
        extension()
    except KernelUnavailable as e:
        return False, f"fused layer ops not used: their kernel did not build ({e.summary})"
    return True, None


class FusedLayerOps:
    """The layer's steps through these kernels: the strategy a target takes when its weight plan says
    `fused` (layers.TorchOps is the other; TorchTarget.forward_layers runs either)."""

    def __init__(self, cfg, attend: bool, wide: bool, causal: bool = True, stack: bool = True):
        """causal=False: every row sees the whole cache up to its block's end (a DFlash draft's block).
        stack=False: never the one-call walk of `layers`, the steps called layer by layer from Python (what the
        tests hold the one-call walk bitwise equal to; the runtime always takes `layers` where it applies)."""
        self.k, self.eps = extension(), cfg.rms_norm_eps
        self.nh, self.nkv, self.attend, self.wide = cfg.num_attention_heads, cfg.num_key_value_heads, attend, wide
        self.causal, self.stack = causal, stack
        self.stacks: dict[int, tuple] = {}  # id(walk) -> (walk, its native arguments or None)
        self.needs_mask = not attend  # the C++ attention masks each row itself; SDPA takes a mask
        # With the C++ attention the K cache is tiled by 16 positions (kernels/fused.cpp, scores_tiled): a
        # tile's scores are one chain of fmas per key, no transposing tree, and verify rows share each
        # loaded tile. Only these ops write and read such a cache (SDPA's views need positions in rows).
        self.tiled = attend

    def layers(self, walk, h, first_norm, cache, start: int, cos, sin, capture) -> tuple | None:
        """(the rows after the final norm, the captured residual streams): the whole walk in one C++ call
        (kernels/fused.cpp `layers`: the same kernels in the same order, so bitwise the walk in Python,
        without its ~270 calls' dispatch: ~1.3-1.7 ms of a decode step on the 2-core EPYC); None where it
        does not apply (the caller walks in Python): SDPA attention, a row batch, a matrix that is not GGUF
        blocks (training's plain tensors), more rows than a float32-rows block product takes."""
        if not (self.stack and self.attend and h.shape[0] == 1):
            return None
        held = self.stacks.get(id(walk))
        if held is None or held[0] is not walk:
            held = self.stacks[id(walk)] = (walk, native_walk(walk))
        args = held[1]
        if args is None or h.shape[1] > args[-1]:
            return None
        mats, modes, amx, ns, biases, norms, qk_norms, _ = args
        out = self.k.layers(h, first_norm, mats, modes, amx, ns, biases, norms, qk_norms, cache.k[:len(walk)],
                            cache.v[:len(walk)], cos, sin, start, self.nh, self.nkv, self.eps, self.wide,
                            self.causal, self.tiled, sorted(capture))
        return out[0], out[1:]

    def slot_layers(self, walk, h, first_norm, kc: list, vc: list, cos, sin, slots, pos) -> torch.Tensor | None:
        """Rows h [R, 1, H], each one token of its own sequence in cache slot slots[r] (per layer caches
        [S, nkv, cap, D]) at position pos[r], through the whole walk in one C++ call: the rows after the final
        norm. Each row takes the steps a decode step of its sequence alone takes (batched data generation: the
        runtime's own greedy answers). None where the one-call walk does not apply."""
        if not (self.attend and self.causal):
            return None
        held = self.stacks.get(id(walk))
        if held is None or held[0] is not walk:
            held = self.stacks[id(walk)] = (walk, native_walk(walk))
        if held[1] is None:
            return None
        mats, modes, amx, ns, biases, norms, qk_norms, _ = held[1]
        return self.k.layers(h, first_norm, mats, modes, amx, ns, biases, norms, qk_norms, kc, vc, cos, sin, 0,
                             self.nh, self.nkv, self.eps, self.wide, self.causal, self.tiled, [], slots, pos)[0]

    def norm(self, h, w):
        return self.k.rms_norm(h, w, self.eps)

    def add_norm(self, h, d, w):
        """(h + d, its norm): the residual add and the next norm in one pass."""
        return self.k.add_rms_norm(h, d, w, self.eps)

    def attention(self, layer, x, cache, i: int, start: int, cos, sin, mask):
        """q|k|v, RoPE, the cache write, attention and o_proj on the normed input x."""
        kc, vc, qkv = cache.k[i], cache.v[i], linear(x, layer.mm_qkv, layer.bqkv)
        norms = () if layer.q_norm is None else (layer.q_norm, layer.k_norm, self.eps)
        if self.attend:  # row by row: the same bits alone or in a verify block; K tiled (see `tiled`)
            q = self.k.rope(qkv, cos, sin, kc, vc, start, self.nh, self.nkv, *(norms or (None, None, 0.0)), self.tiled)
            o = self.k.attend(q, kc, vc, start, self.wide, self.causal, self.tiled)
        else:
            q, keys, values = self.k.rope_qkv(qkv, cos, sin, kc, vc, start, self.nh, self.nkv, True, norms)
            o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                                 enable_gqa=self.nkv != self.nh).transpose(1, 2)
        return linear(o.reshape(1, -1, layer.nq), layer.mm_o)

    def mlp(self, layer, x):
        return linear(self.k.silu_mul(linear(x, layer.mm_gate_up)), layer.mm_down)

    def context_kv(self, layer, x, cache, i: int, start: int, cos, sin) -> None:
        """A draft's context: k (k-normed, with RoPE) and v of the fused features x into the caches at start..
        (the RoPE op with no query heads)."""
        norms = (None, None, 0.0) if layer.k_norm is None else (layer.k_norm, layer.k_norm, self.eps)
        self.k.rope(linear(x, layer.mm_kv, layer.bkv), cos, sin, cache.k[i], cache.v[i], start, 0, self.nkv, *norms,
                    self.tiled)


def native_walk(walk) -> tuple | None:
    """The walk's weights as the `layers` op takes them (lists built once), or None when a matrix is not
    GGUF blocks with a native product. The last item: the most rows every product takes."""
    from . import quant, quant8

    mats, modes, amx, ns, biases, norms, qk_norms, rows = [], [], [], [], [], [], [], 1 << 30
    empty = torch.empty(0)
    for layer, post_norm, next_norm in walk:
        for name in ("mm_qkv", "mm_o", "mm_gate_up", "mm_down"):
            mm = getattr(layer, name)
            if not isinstance(mm, quant.Quantized):
                return None
            int8 = isinstance(mm, quant8.Int8Blocks)
            mats.append(mm.packed)
            modes.append(4 * int8 + 2 * mm.avx512 + (mm.kind == quant.Q4_1))
            amx.append(mm.amx_rows if int8 else 0)
            ns.append(mm.n)
            rows = rows if int8 else min(rows, quant.MAX_ROWS)
        biases.append(empty if layer.bqkv is None else layer.bqkv)
        norms += [post_norm, next_norm]
        if layer.q_norm is not None:
            qk_norms += [layer.q_norm, layer.k_norm]
    if qk_norms and len(qk_norms) != 2 * len(walk):
        return None
    return mats, modes, amx, ns, biases, norms, qk_norms, rows
