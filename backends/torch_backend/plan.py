"""The weight plan: how each of a torch target's matrices is stored and multiplied, decided once at load,
in one place, from the caller's LoadPolicy, the device and dtype, the CPU's flags and the model's GGUF:
- dense: the [in, out] matrix as it is (other devices and dtypes; training; the policy's gemm=False);
- packed: float32 CPU weights packed for the decoding GEMM (gemm.py);
- GGUF blocks: decode/verify rows multiplied by the GGUF's Q4_1/Q8_0 blocks (quant.py), the packed or
  dense weight serving longer inputs; or the same blocks times int8 rows (quant8.py, `--dtype int8`);
- the draft's head: the target's head blocks times int8 rows, or the target's own head;
- the layer's ops: fused C++ ops (fused.py) or torch's, and the K/V cache's dtype and layout.
Everything is decided, and every note written, before a module is built: a WeightPlan is frozen (its blocks a
read-only mapping, its notes a tuple), the modules only read it and ask it for their multipliers, and the stats
name it (`describe`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping

import numpy as np
import torch

from hetero_sd.backends.policy import DEFAULT, LoadPolicy
from hetero_sd.errors import ConfigError
from hetero_sd.models.layout import layer_shapes

from . import fused, gemm, quant, quant8
from .cpu import cpu_flags
from .kernels import KernelUnavailable

KERNEL_NOTE = "float32 decoding GEMM kernel unavailable"
FLOAT32, INT8 = "float32", "int8"
LAYER_MATRICES = {"mm_qkv": ("q_proj", "k_proj", "v_proj"), "mm_o": ("o_proj",),
                  "mm_gate_up": ("gate_proj", "up_proj"), "mm_down": ("down_proj",)}


class BlocksRefused(ValueError):
    """The GGUF's blocks cannot stand for the float32 weights (the plan then goes without them)."""


@dataclass(frozen=True)
class WeightPlan:
    device: str
    dtype: torch.dtype
    policy: LoadPolicy = DEFAULT
    flags: frozenset[str] = frozenset()
    activations: str = FLOAT32  # "int8": rows quantized to int8 into the GGUF blocks (another target)
    pack: bool = False  # float32 CPU matrices packed for gemm.py (its kernel built and runs on this CPU)
    blocks: Mapping | None = None  # the GGUF's rows by our names ('lm_head', (layer, 'q_proj'), ...), read-only
    fused: bool = False  # the fused C++ layer ops (fused.py) instead of torch's
    attend: bool = False  # the fused causal attention (x86-64 with AVX2+FMA, head_dim 64 or 128), else SDPA
    attend_wide: bool = False  # its 16-lane AVX-512 stages
    kv_dtype: torch.dtype | None = None  # the K/V cache's, where it is not `dtype` (float16: llama.cpp's cache)
    k_q8: bool = False  # K as q8_0 blocks (llama.cpp's -ctk q8_0; kernels/attend_q8.h), V in kv_dtype
    notes: tuple[str, ...] = ()  # what the caller is told (kernels that did not build, the formats chosen)

    @property
    def weights(self) -> str:
        """The weights' name in stats: 'float32', 'Q4_1/Q8_0 blocks from the GGUF', '... x int8 rows'."""
        if not self.blocks:
            return str(self.dtype).removeprefix("torch.")
        kinds = "/".join(sorted({kind for kind, _ in self.blocks.values()}))
        return f"{kinds} blocks from the GGUF" + (" x int8 rows" if self.activations == INT8 else "")

    @property
    def one_call_walk(self) -> bool:
        """Whether the fused ops walk all the layers in one C++ call (fused.FusedLayerOps.layers): GGUF blocks
        on the C++ attention."""
        return bool(self.fused and self.attend and self.blocks)

    def describe(self) -> str:
        """One line for stats and the cost key: the formats and ops chosen."""
        parts = [self.weights]
        parts += ["packed float32 GEMM"] * (self.pack and not self.blocks)
        parts += ["fused layer ops"] * self.fused
        parts += ["one-call layer walk"] * self.one_call_walk
        parts += [kv_name(self)] * (self.kv_dtype == torch.float16)
        return ", ".join(parts)

    # ---- the multipliers, asked for by the modules while they are built (the plan is only read) ----

    def dense(self, weight_t: torch.Tensor):
        """A matrix without blocks: packed for gemm.py on a float32 CPU where the plan packs, else as is."""
        if not self.pack or weight_t.device.type != "cpu" or weight_t.dtype != torch.float32:
            return weight_t
        return gemm.Packed(weight_t, gemm.isa(self.flags))

    def matrix(self, key, weight_t: torch.Tensor):
        """key: (layer, 'mm_qkv' | 'mm_o' | 'mm_gate_up' | 'mm_down') or 'mm_head'."""
        rows = self.rows_for(key) if key == "mm_head" or key[1] in LAYER_MATRICES else None
        if rows is None:
            return self.dense(weight_t)
        kind, data = rows
        kernel = quant8.Int8Blocks if self.activations == INT8 else quant.Quantized
        try:
            if kernel is quant8.Int8Blocks:
                return kernel(kind, data, self.dense(weight_t), None, quant8.isa(flags=self.flags))
            return kernel(kind, data, self.dense(weight_t), weight_t, quant.isa(flags=self.flags))
        except (KernelUnavailable, ValueError) as e:
            raise BlocksRefused(getattr(e, "summary", str(e))) from e

    def rows_for(self, key):
        """(kind, the GGUF rows) of a matrix with blocks, else None."""
        parts = self.parts_of(key)
        return None if parts is None else (parts[0][0], np.concatenate([rows for _, rows in parts]))

    def parts_of(self, key) -> list | None:
        """The (kind, rows) of a matrix's parts (q, k and v for 'mm_qkv'), or None where it has no blocks (some
        part missing, or parts of different kinds)."""
        if not self.blocks:
            return None
        if key == "mm_head":
            return [self.blocks["lm_head"]] if "lm_head" in self.blocks else None
        layer, name = key
        got = [self.blocks.get((layer, part)) for part in LAYER_MATRICES[name]]
        if any(g is None for g in got) or len({g[0] for g in got}) != 1:
            return None
        return got

    def draft_head(self, head_mm, lm_head_t: torch.Tensor):
        """What a CPU draft multiplies its block by: the head blocks times int8 rows (a draft only proposes,
        so its logits need not have the target's numerics: at 16 rows that kernel is ~2.5x the float32-exact
        one and reads half the bytes of a bf16 head), else None (the target's own head)."""
        head = self.blocks.get("lm_head") if self.blocks else None
        if head is None or not self.policy.draft_int8_head:
            return None
        if self.activations == INT8:
            return head_mm
        try:
            return quant8.Int8Blocks(head[0], head[1], head_mm.fallback, None, quant8.isa(flags=self.flags))
        except KernelUnavailable:  # the target's own head then; nothing the user chose is lost
            return None

    def draft_blocks(self, weight_t: torch.Tensor):
        """A draft's own matrix [in, out] as GGUF blocks quantized at load (gguf's quantizer; Q8_0, or Q4_1 where
        the policy says so), times int8 rows; dense where its shape or dtype has no blocks. Only for a draft whose
        head is already int8 rows x blocks, so the int8 kernel runs here (KernelUnavailable otherwise): a draft
        only proposes, the target verifies every token. Q8_0 reads a quarter of float32's bytes (a block
        of 4 on the default pair: 2.9 -> 1.9 ms on a 2-core AVX2 EPYC). Q4_1 reads less again and makes each block
        cheaper, but the coarser layers lose the long blocks what they save per block (HumanEval's tau 2.22 -> 2.10
        on the 2-core Zen 5), so Q8_0 is the default."""
        if weight_t.shape[0] % 32 or weight_t.dtype != torch.float32 or weight_t.device.type != "cpu":
            return self.dense(weight_t)
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        why = int8_kernel_missing(self.policy, self.flags)
        if why:
            raise KernelUnavailable(f"a draft's int8 layers: {why}")
        kind = quant.Q4_1 if self.policy.draft_layer_blocks == quant.Q4_1 else quant.Q8_0
        rows = quantize(weight_t.t().contiguous().numpy(), GGMLQuantizationType[kind])
        return quant8.Int8Blocks(kind, rows, self.dense(weight_t), None, quant8.isa(flags=self.flags))

    def without_blocks(self, why: str) -> "WeightPlan":
        """Another plan: this one without the GGUF's blocks (the weights refused them), its blocks note replaced."""
        note = f"{quant.NOTE}: float32 (the GGUF's Q4_1/Q8_0 blocks are not used: {why})"
        if self.activations == INT8:
            raise ConfigError(f"--dtype {self.activations}: {why}", "use --dtype float32")
        kept = tuple(n for n in self.notes if not n.startswith(f"{quant.NOTE}: {self.weights}:"))
        return replace(self, blocks=None, notes=kept + (note,))

    def blocks_note(self, cfg) -> str:
        """What the blocks stand for: how many of the target's matrices, their bytes against float32's."""
        parts = [p for p in map(self.parts_of, ["mm_head"] + [(i, name) for i in range(cfg.num_hidden_layers)
                                                              for name in LAYER_MATRICES]) if p is not None]
        read = sum(rows.nbytes for part in parts for _, rows in part)
        shapes = layer_shapes(cfg)
        per_layer = sum(shapes[n][0] * shapes[n][1] for names in LAYER_MATRICES.values() for n in names)
        numel = cfg.hidden_size * cfg.vocab_size + cfg.num_hidden_layers * per_layer
        steps, prefill = f"decode and verify steps (1-{quant.MAX_ROWS} rows)", "; prefill uses the float32 copy"
        kernel = quant8 if self.activations == INT8 else quant
        if self.activations == INT8:  # (quant8.Int8Blocks takes any number of rows, as llama.cpp does)
            steps, prefill = "decode, verify and prefill steps", ""
        return (f"{quant.NOTE}: {self.weights}: {steps} multiply {len(parts)} of the target's matrices by their GGUF "
                f"blocks ({read / 1e6:.0f} MB instead of {numel * 4 / 1e6:.0f} MB of float32), "
                f"{kernel.how(kernel.isa(flags=self.flags))}{prefill}")


def int8_kernel_missing(policy: LoadPolicy, flags: frozenset[str] | None) -> str | None:
    """Why the int8-row kernel cannot run on a CPU with these flags (None: this one's), or None when it can."""
    if quant8.isa(flags=flags) is None:
        return "this CPU has neither AVX512-VNNI nor AVX2+FMA+F16C"
    try:
        quant8.extension()
    except KernelUnavailable as e:
        return e.summary
    return None


def default_activations(gguf, device: str, policy: LoadPolicy, flags: frozenset[str]) -> tuple[str, str | None]:
    """The numerics of a target loaded with no dtype asked: (FLOAT32 or INT8, a note when the default could not
    be had). A CPU target converted from a GGUF multiplies int8 rows by its blocks, as llama.cpp does (end to end
    on a 2-core AVX2 EPYC, 1.33x float32's tokens/s plain, 1.27x with the shipped draft). Everything else stays
    float32."""
    if device != "cpu" or gguf is None or not policy.quant:
        return FLOAT32, None
    why = int8_kernel_missing(policy, flags)
    if why:
        return FLOAT32, (f"target numerics: float32, not the default int8 rows x GGUF blocks ({why}); "
                         "tokens are those of the float32 target, at its slower speed")
    return INT8, None


def plan_target(cfg, gguf, device: str, dtype: torch.dtype, activations: str, policy: LoadPolicy,
                flags: frozenset[str]) -> WeightPlan:
    """The whole plan for a target from its config and GGUF (None: not converted from one), decided before any
    module is built: each matrix's format, the layer's ops, the K/V cache, and the notes that say so."""
    cpu32 = device == "cpu" and dtype == torch.float32
    if activations != FLOAT32 and (gguf is None or not cpu32):
        raise ConfigError(f"--dtype {activations} needs a CPU target converted from a Q4_1/Q8_0 GGUF",
                          "use the embedded default target (--target default), or --dtype float32")
    pack, notes = packing(cpu32 and policy.gemm, flags)
    plan = WeightPlan(device, dtype, policy, flags, activations, pack, notes=notes)
    if gguf is not None and cpu32:
        plan = with_blocks(plan, gguf, cfg)
    fuses, why_not = fused.fusable(cfg, device, dtype, policy)
    attend = fuses and fused.extension().has_attend and cfg.head_dim in (64, 128) and {"avx2", "fma"} <= flags
    wide = attend and "avx512f" in flags
    # llama.cpp's numerics keep K/V in float16: half the bytes a decode step's attention reads (~20% of a step
    # at 512 tokens) and half the memory per position. Only where the C++ attention reads the cache (it converts
    # as it loads); decode and verify read the same stored values, so they still agree bit for bit.
    # Where the 16-lane stages have VNNI, K as q8_0 blocks (llama.cpp's -ctk q8_0): the scores become int8 dot
    # products and K reads 72 bytes a position and head instead of 128 (end to end with the shipped draft 1.07x
    # tokens/s on the 2-core Zen 5); its shift from a float32 cache's predictions is of the float16 cache's size.
    half = activations == INT8 and attend and "f16c" in flags and policy.kv_f16
    k_q8 = half and policy.k_q8 and wide and Q8_K_FLAGS <= flags
    notes = plan.notes + ((why_not,) if why_not else ())
    if k_q8:
        notes += ("KV cache: K as q8_0 blocks and V float16, as llama.cpp keeps them with -ctk q8_0 (scores as int8 "
                  "dot products; HETERO_SD_KV=float16 keeps K in float16)",)
    elif half:
        notes += ("KV cache: float16, as llama.cpp keeps it (half the bytes per position; HETERO_SD_KV=float32 keeps "
                  "float32)" + ("; K as q8_0 blocks would need AVX512-VNNI" if policy.k_q8 else ""),)
    plan = replace(plan, fused=fuses, attend=attend, attend_wide=wide, kv_dtype=torch.float16 if half else None,
                   k_q8=k_q8, notes=notes)
    return replace(plan, notes=plan.notes + (plan.blocks_note(cfg),)) if plan.blocks else plan


def plan_matrices(device: str, dtype: torch.dtype, policy: LoadPolicy = DEFAULT, pack: bool = True,
                  flags: frozenset[str] | None = None) -> WeightPlan:
    """The plan for matrices without GGUF blocks (a draft's own, a layer built on its own): float32 CPU
    matrices packed for gemm.py where its kernel runs here (else dense, the reason in the notes), others dense."""
    flags = cpu_flags() if flags is None else flags
    cpu32 = torch.device(device).type == "cpu" and dtype == torch.float32
    packs, notes = packing(pack and cpu32 and policy.gemm, flags)
    return WeightPlan(device, dtype, policy, flags, pack=packs, notes=notes)


def packing(wanted: bool, flags: frozenset[str]) -> tuple[bool, tuple[str, ...]]:
    """(whether float32 matrices are packed for gemm.py, the note when they were wanted and cannot be)."""
    if not wanted:
        return False, ()
    try:
        if gemm.isa(flags) is None:
            raise KernelUnavailable("this CPU has neither AVX-512 nor AVX2+FMA")
        gemm.extension()
    except KernelUnavailable as e:
        return False, (f"{KERNEL_NOTE}: {e.summary}; float32 matmuls use torch's (slower for verify-sized blocks)",)
    return True, ()


Q8_K_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni", "f16c"})


def kv_name(plan: WeightPlan) -> str:
    """The K/V cache in stats and the cost key."""
    return "q8_0 K + float16 V cache" if plan.k_q8 else "float16 KV cache"


def with_blocks(plan: WeightPlan, gguf, cfg) -> WeightPlan:
    """The plan with the GGUF's rows by our names (read-only), or without them and a note saying why."""
    if not plan.policy.quant and plan.activations == FLOAT32:
        return replace(plan, notes=plan.notes + (f"{quant.NOTE}: float32 ({plan.policy.why()}; the GGUF's blocks "
                                                 "are not used)",))
    kernel = quant8 if plan.activations == INT8 else quant
    try:
        if kernel.isa(flags=plan.flags) is None:
            raise KernelUnavailable(f"this CPU has no {'AVX512-VNNI nor ' if kernel is quant8 else 'AVX-512 nor '}"
                                    "AVX2+FMA+F16C")
        kernel.extension()
        rows = quant.gguf_rows(gguf, cfg)
    except (KernelUnavailable, ValueError, OSError, KeyError) as e:
        return plan.without_blocks(getattr(e, "summary", str(e)))
    head = rows.pop("embed") if cfg.tie_word_embeddings and "embed" in rows else rows.pop("lm_head", None)
    rows.pop("embed", None)
    if head is not None:
        rows["lm_head"] = head
    if not rows and plan.activations == INT8:
        return plan.without_blocks("no GGUF blocks")
    return replace(plan, blocks=MappingProxyType(rows)) if rows else plan
