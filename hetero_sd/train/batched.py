"""Batched greedy generation for self-distillation data, on the target's own weights in plain torch.

Why not transformers' `generate`: a batch there runs until its longest answer ends (rows that hit EOS
keep computing padding) and every prompt in it is padded to the longest. Here the batch is a set of
slots over one KV cache [slots, kv_heads, positions, head_dim] per layer, each slot at its own
position: a row that reaches EOS leaves at once and the next prompt is prefilled into its slot, so
every decode step does useful work for nearly every slot.

The forward is the target's own (backends/torch_backend/target.py: TargetModel, the module the runtime
runs). Two plans:
- `numerics="int8"`, the default CPU target of a GGUF, on the runtime's own plan and kernels (int8 rows x its
  GGUF blocks, the fused C++ layer ops, the K/V cache the runtime keeps: q8_0 K or float16, tiled): a prompt is
  prefilled alone through the runtime's one-call layer walk into its slot, and a decode step is ONE call for
  every slot's row (kernels/fused.cpp `layers` with slots: each row its own RoPE position and its own slot's
  attention, which takes the very steps a decode step of that sequence alone takes). The answers are then
  bitwise the runtime's own greedy answers. Where the fused attention is unavailable it runs on torch's ops
  (announced in `notes`; answers then part from the runtime's at near-ties).
- float32 (plain [in, out] matrices: the fast layout for batched float32 rows, torch's ops); its attention
  for one query per row is written here. Answers equal the runtime's float32 greedy decoding up to float
  rounding of batched attention."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.backends.torch_backend.layers import DecoderLayer, Rope, TorchOps, k_layout, linear
from hetero_sd.backends.torch_backend.cpu import cpu_flags
from hetero_sd.backends.torch_backend.plan import FLOAT32, INT8, plan_target
from hetero_sd.backends.torch_backend.target import build_target
from hetero_sd.models.config import ArchConfig, read_json
from hetero_sd.errors import ConfigError
from hetero_sd.models.weights import converted_from, load_weights

# dense matrices and torch's ops: the plan for many rows at once (packing and blocks serve 1-64 rows)
PLAIN = LoadPolicy(quant=False, fused=False, gemm=False, origin="batched data generation")
# int8 rows x the GGUF blocks for every matrix, and the runtime's fused C++ ops around them
BLOCKS = LoadPolicy(gemm=False, origin="batched data generation")


@dataclass
class Answer:
    key: str
    prompt_ids: list[int]
    response_ids: list[int]
    finished: bool  # ended with a stop token (else cut at max_new_tokens)


class BatchedGenerator:
    """Greedy answers for many prompts: `generate(prompts)` yields an Answer as each one finishes."""

    def __init__(self, folder: Path, *, slots: int = 48, max_new_tokens: int = 256, max_prompt_tokens: int = 512,
                 stop_ids: Iterable[int] = (), dtype: torch.dtype = torch.float32, numerics: str = FLOAT32,
                 k_q8: bool = True):
        """k_q8=False: the int8 plan's K cache in float16 where the runtime's default keeps q8_0 blocks (the runtime
        loaded with HETERO_SD_KV=float16); `self.k_q8` says which one the answers come from."""
        cfg = ArchConfig.from_dict(read_json(folder / "config.json"))
        self.cfg, self.slots, self.max_new, self.max_prompt = cfg, slots, max_new_tokens, max_prompt_tokens
        self.stop = set(stop_ids) or set(cfg.eos_token_ids)
        self.dtype, self.notes = dtype, []
        planned = self.plan(folder, cfg, dtype, numerics, k_q8)
        self.model = build_target(cfg, load_weights(folder), folder, "cpu", dtype, planned)
        plan = self.model.plan
        # slots on the runtime's fused kernels: one C++ call per decode step (int8 rows need every row's bits alone)
        self.fused = numerics == INT8 and plan.fused and plan.attend
        if numerics == INT8 and not self.fused:
            self.notes.append("batched int8 generation on torch's ops: the fused C++ attention is not available here "
                              f"({'; '.join(plan.notes) or 'no AVX2+FMA'}), so answers may part from the runtime's at near-ties")
        self.kv_dtype = (plan.kv_dtype or dtype) if self.fused else dtype
        self.k_q8 = self.answers_k_q8(plan, numerics)
        assert self.k_q8 == self.answers_k_q8(planned, numerics), "the plan's K cache changed as the target was built"
        self.k_width, self.k_dtype = k_layout(cfg.head_dim, self.kv_dtype, self.k_q8)
        self.positions = -(-(max_prompt_tokens + max_new_tokens) // 16) * 16  # whole tiles (the tiled K cache)
        self.cos, self.sin = Rope(cfg, "cpu", dtype).at(0, self.positions)

    @staticmethod
    def plan(folder: Path, cfg: ArchConfig, dtype: torch.dtype, numerics: str, k_q8: bool = True):
        """The weight plan the generator loads the target with (plan.py), known before any weight loads."""
        if numerics == INT8:
            gguf = converted_from(folder)
            if gguf is None:
                raise ConfigError(f"int8 data generation needs a target converted from a Q4_1/Q8_0 GGUF; {folder} "
                                  "is not one", "use --dtype float32, or the GGUF target")
            return plan_target(cfg, gguf, "cpu", torch.float32, INT8, replace(BLOCKS, k_q8=k_q8), cpu_flags())
        return plan_target(cfg, None, "cpu", dtype, FLOAT32, PLAIN, frozenset())

    @staticmethod
    def answers_k_q8(plan, numerics: str) -> bool:
        """Whether answers made on this plan come from a q8_0 K cache (only the slots' fused kernels keep one)."""
        return numerics == INT8 and plan.fused and plan.attend and plan.k_q8

    # -- the forward pass: the target module's, with the slots' attention -----------------------------

    def new_cache(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (rows, self.cfg.num_key_value_heads, self.positions)
        return [(torch.zeros(shape + (self.k_width,), dtype=self.k_dtype),
                 torch.zeros(shape + (self.cfg.head_dim,), dtype=self.kv_dtype)) for _ in range(self.cfg.num_hidden_layers)]

    @torch.inference_mode()
    def prefill(self, cache, slots: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Run prompts (right-padded to one length) into the cache rows `slots`; greedy first tokens [n].

        Padding sits after each prompt and the mask is causal, so it never reaches a real position; the
        padded K/V rows are overwritten by the row's own later tokens and masked until then. On the fused
        plan each prompt runs alone into its slot, as the runtime prefills it (the same call, the same bits)."""
        if self.fused:
            first = []
            for s, ids in zip(slots.tolist(), prompts):
                view = SlotView([k[s:s + 1] for k, _ in cache], [v[s:s + 1] for _, v in cache])
                normed, _ = self.model(torch.tensor([ids]), view, 0, self.cos[:len(ids)], self.sin[:len(ids)], None)
                first.append(self.model.logits(normed[0, -1:]).argmax(-1))
            return torch.cat(first)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        mask = torch.ones(width, width, dtype=torch.bool).tril()
        normed, _ = self.model(ids, cache, 0, self.cos[:width], self.sin[:width], mask,
                               ops=PrefillSlots(self.cfg.rms_norm_eps, slots))
        last = torch.tensor([len(p) - 1 for p in prompts])
        return self.model.logits(normed[torch.arange(len(prompts)), last]).argmax(-1)

    @torch.inference_mode()
    def decode_slots(self, cache, slots: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The fused plan's step: one token per row, row r in cache slot slots[r] at position pos[r], all rows in
        one C++ call: greedy next tokens [rows]."""
        h = F.embedding(tokens[:, None], self.model.embed)
        normed = self.model.ops.slot_layers(self.model.walk, h, self.model.first_norm, [k for k, _ in cache],
                                            [v for _, v in cache], self.cos[pos], self.sin[pos], slots, pos)
        return self.model.logits(normed[:, 0]).argmax(-1)

    @torch.inference_mode()
    def decode(self, cache, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One token per cache row, each at its own position: greedy next tokens [rows]."""
        if self.fused:
            return self.decode_slots(cache, torch.arange(tokens.shape[0]), tokens, pos)
        span = int(pos.max()) + 1
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]
        mask = (torch.arange(span)[None, :] <= pos[:, None])[:, None, None]  # [rows, 1, 1, span]
        bias = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf"))
        normed, _ = self.model(tokens[:, None], cache, 0, cos, sin, bias,
                               ops=DecodeSlots(self.cfg.rms_norm_eps, pos, span))
        return self.model.logits(normed[:, 0]).argmax(-1)

    # -- scheduling ---------------------------------------------------------------------------------

    def generate(self, prompts: Iterable[tuple[str, list[int]]]) -> Iterator[Answer]:
        """Answers in the order they finish. Prompts longer than max_prompt_tokens are an error: the
        caller filters by length (it knows why a prompt is too long)."""
        queue = iter(prompts)
        rows = Rows(self.slots)
        cache = self.new_cache(self.slots)
        while True:
            yield from self.finished(rows)  # after a decode step, or a prefill whose first token ends it
            if rows.free() and not rows.exhausted:
                self.refill(cache, rows, queue)
                if any(self.done(rows, s) for s in rows.active()):
                    continue
            if not rows.active():
                return
            live = rows.active()
            if self.fused:  # only the live slots' rows: no compaction needed for the tail
                nxt = self.decode_slots(cache, torch.tensor(live), torch.tensor([rows.out[s][-1] for s in live]),
                                        torch.tensor([rows.length[s] for s in live])).tolist()
                for s, t in zip(live, nxt):
                    rows.length[s] += 1
                    rows.out[s].append(t)
                continue
            if rows.exhausted and len(rows.active()) <= 3 * len(rows.keys) // 4:
                cache = rows.compact(cache)  # the tail: no prompts left to fill free slots
                live = rows.active()
            tokens = torch.tensor([rows.out[s][-1] if rows.keys[s] else 0 for s in range(len(rows.keys))])
            pos = torch.tensor([rows.length[s] if rows.keys[s] else 0 for s in range(len(rows.keys))])
            nxt = self.decode(cache, tokens, pos).tolist()
            for s in live:
                rows.length[s] += 1
                rows.out[s].append(nxt[s])

    def refill(self, cache, rows: "Rows", queue) -> None:
        free = rows.free()
        new = []
        for s in free:
            item = None if rows.exhausted else next(queue, None)
            if item is None:
                rows.exhausted = True
                break
            key, ids = item
            if len(ids) > self.max_prompt:
                raise ValueError(f"prompt {key} has {len(ids)} tokens, more than max_prompt_tokens")
            new.append((s, key, list(ids)))
        if not new:
            return
        first = self.prefill(cache, torch.tensor([s for s, _, _ in new]), [ids for _, _, ids in new]).tolist()
        for (s, key, ids), t in zip(new, first):
            rows.start(s, key, ids, t)

    def done(self, rows: "Rows", s: int) -> bool:
        return rows.out[s][-1] in self.stop or len(rows.out[s]) >= self.max_new

    def finished(self, rows: "Rows") -> Iterator[Answer]:
        for s in rows.active():
            if self.done(rows, s):
                out = rows.out[s]
                yield Answer(rows.keys[s], rows.prompt[s], out, out[-1] in self.stop)
                rows.clear(s)


class SlotView:
    """One slot of the caches as a one-sequence cache ([1, nkv, cap, D] views per layer): what the runtime's
    layer walk writes a prompt into."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v = k, v


class PrefillSlots(TorchOps):
    """The layer's attention for prompts right-padded into the cache rows `slots`: each row attends to its
    own prompt (causal `mask`); its K/V go into its slot from position 0."""

    def __init__(self, eps: float, slots: torch.Tensor):
        super().__init__(eps)
        self.slots = slots

    def attention(self, layer: DecoderLayer, x, cache, i: int, start: int, cos, sin, mask):
        q, k, v = layer.project_qkv(x, cos, sin)
        kc, vc = cache[i]
        kc[self.slots, :, :k.shape[2]], vc[self.slots, :, :k.shape[2]] = k, v
        return layer.attention(q, k, v, mask)


class DecodeSlots(TorchOps):
    """The layer's attention for one query per cache row, each at its own position `pos`, over the keys up
    to `span`; `mask` is the additive bias hiding each row's keys past its position. Written out instead
    of SDPA: the query heads that share a K/V head go in one matmul, so K/V are read once and never
    repeated per head. Measured with 48 rows and spans up to 600: 2.6 ms per layer against 3.2 ms for
    the CPU's SDPA kernel."""

    def __init__(self, eps: float, pos: torch.Tensor, span: int):
        super().__init__(eps)
        self.pos, self.span, self.index = pos, span, torch.arange(pos.shape[0])

    def attention(self, layer: DecoderLayer, x, cache, i: int, start: int, cos, sin, mask):
        q, k, v = layer.project_qkv(x, cos, sin)
        kc, vc = cache[i]
        kc[self.index, :, self.pos], vc[self.index, :, self.pos] = k[:, :, 0], v[:, :, 0]
        keys, values = kc[:, :, :self.span], vc[:, :, :self.span]
        rows, kv, hd = keys.shape[0], keys.shape[1], layer.cfg.head_dim
        qg = q.reshape(rows, kv, -1, hd)  # [rows, kv, group, hd]: heads are kv-major
        scores = (qg @ keys.transpose(2, 3)) * hd ** -0.5 + mask
        o = (scores.float().softmax(-1).to(values.dtype) @ values).reshape(rows, 1, layer.nq)
        return linear(o, layer.mm_o)


class Rows:
    """Who occupies which cache slot: key, prompt, answer so far, and the slot's next position."""

    def __init__(self, n: int):
        self.keys: list[str | None] = [None] * n
        self.prompt: list[list[int]] = [[] for _ in range(n)]
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.length = [0] * n
        self.exhausted = False

    def free(self) -> list[int]:
        return [s for s, k in enumerate(self.keys) if k is None]

    def active(self) -> list[int]:
        return [s for s, k in enumerate(self.keys) if k is not None]

    def start(self, s: int, key: str, prompt: list[int], first: int) -> None:
        self.keys[s], self.prompt[s], self.out[s], self.length[s] = key, prompt, [first], len(prompt)

    def clear(self, s: int) -> None:
        self.keys[s], self.prompt[s], self.out[s], self.length[s] = None, [], [], 0

    def compact(self, cache):
        keep = self.active()
        index = torch.tensor(keep)
        for name in ("keys", "prompt", "out", "length"):
            setattr(self, name, [getattr(self, name)[s] for s in keep])
        return [(k[index], v[index]) for k, v in cache]
