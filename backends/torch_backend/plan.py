"""The weight plan: how each of a torch target's matrices is stored and multiplied, decided once at load,
in one place, from the caller's LoadPolicy, the device and dtype, the CPU's flags and the model's GGUF:
- dense: the [in, out] matrix as it is (other devices and dtypes; training; the policy's gemm=False);
- packed: float32 CPU weights packed for the decoding GEMM (gemm.py);
- GGUF blocks: decode/verify rows multiplied by the GGUF's Q4_1/Q8_0 blocks (quant.py), the packed or
  dense weight serving longer inputs; or the same blocks times int8 rows (quant8.py, `--dtype int8`);
- the draft's head: the target's head blocks times int8 rows, or the target's own head;
- the layer's ops: fused C++ ops (fused.py) or torch's.
Nothing is replaced after the modules are built; the stats name the plan (`describe`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hetero_sd.backends.policy import DEFAULT, LoadPolicy
from hetero_sd.errors import ConfigError

from . import fused, gemm, quant, quant8
from .kernels import KernelUnavailable

KERNEL_NOTE = "float32 decoding GEMM kernel unavailable"
FLOAT32, INT8 = "float32", "int8"
LAYER_MATRICES = {"mm_qkv": ("q_proj", "k_proj", "v_proj"), "mm_o": ("o_proj",),
                  "mm_gate_up": ("gate_proj", "up_proj"), "mm_down": ("down_proj",)}


class BlocksRefused(ValueError):
    """The GGUF's blocks cannot stand for the float32 weights (the plan then goes without them)."""


@dataclass
class WeightPlan:
    device: str
    dtype: torch.dtype
    policy: LoadPolicy = DEFAULT
    flags: frozenset[str] = frozenset()
    activations: str = FLOAT32  # "int8": rows quantized to int8 into the GGUF blocks (another target)
    pack: bool = False  # float32 CPU matrices packed for gemm.py
    blocks: dict | None = None  # the GGUF's rows by our names ('lm_head', (layer, 'q_proj'), ...)
    fused: bool = False  # the fused C++ layer ops (fused.py) instead of torch's
    attend: bool = False  # the fused causal attention (x86-64 with AVX2+FMA, head_dim 64 or 128), else SDPA
    attend_wide: bool = False  # its 16-lane AVX-512 stages
    kv_dtype: torch.dtype | None = None  # the K/V cache's, where it is not `dtype` (float16: llama.cpp's cache)
    k_q8: bool = False  # K as q8_0 blocks (llama.cpp's -ctk q8_0; kernels/attend_q8.h), V in kv_dtype
    notes: list[str] = field(default_factory=list)

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
        on the C++ attention, unless the policy says no."""
        return bool(self.fused and self.attend and self.blocks and self.policy.stack)

    def describe(self) -> str:
        """One line for stats and the cost key: the formats and ops chosen."""
        parts = [self.weights]
        parts += ["packed float32 GEMM"] * (self.pack and not self.blocks)
        parts += ["fused layer ops"] * self.fused
        parts += ["one-call layer walk"] * self.one_call_walk
        parts += [kv_name(self)] * (self.kv_dtype == torch.float16)
        return ", ".join(parts)

    # ---- the multipliers, asked for by the modules while they are built ----

    def dense(self, weight_t: torch.Tensor):
        """A matrix without blocks: packed for gemm.py on a float32 CPU (when the kernel builds), else as is."""
        if not self.pack or weight_t.device.type != "cpu" or weight_t.dtype != torch.float32:
            return weight_t
        try:
            return gemm.Packed(weight_t, gemm.isa(self.flags))
        except KernelUnavailable as e:  # announced once; torch's matmul from then on
            self.notes.append(f"{KERNEL_NOTE}: {e.summary}; float32 matmuls use torch's (slower for verify-sized blocks)")
            self.pack = False
            return weight_t

    def note_gemm_off(self) -> None:
        """Announce a float32 CPU plan whose policy turned the GEMM kernel off."""
        if not self.policy.gemm and torch.device(self.device).type == "cpu" and self.dtype == torch.float32:
            self.notes.append(f"{KERNEL_NOTE}: {self.policy.why()}; float32 matmuls use torch's (slower for "
                              "verify-sized blocks)")

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
        if not self.blocks:
            return None
        if key == "mm_head":
            return self.blocks.get("lm_head")
        layer, name = key
        got = [self.blocks.get((layer, part)) for part in LAYER_MATRICES[name]]
        if any(g is None for g in got) or len({g[0] for g in got}) != 1:
            return None
        return got[0][0], np.concatenate([g[1] for g in got])

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
        the policy says so), times int8 rows, else dense. Only for a draft whose head is already int8 rows x blocks
        (a draft only proposes; the target verifies every token). Q8_0 reads a quarter of float32's bytes (a block
        of 4 on the default pair: 2.9 -> 1.9 ms on a 2-core AVX2 EPYC). Q4_1 reads less again and makes each block
        cheaper, but the coarser layers lose the long blocks what they save per block (HumanEval's tau 2.22 -> 2.10
        on the 2-core Zen 5), so Q8_0 is the default."""
        if weight_t.shape[0] % 32 or weight_t.dtype != torch.float32 or weight_t.device.type != "cpu":
            return self.dense(weight_t)
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        why = int8_kernel_missing(self.policy, None)
        if why is None:
            try:
                kind = quant.Q4_1 if self.policy.draft_layer_blocks == quant.Q4_1 else quant.Q8_0
                rows = quantize(weight_t.t().contiguous().numpy(), GGMLQuantizationType[kind])
                return quant8.Int8Blocks(kind, rows, self.dense(weight_t), None, quant8.isa())
            except KernelUnavailable as e:
                why = e.summary
        note = f"draft layers: float32 (no int8 kernel: {why})"
        if note not in self.notes:
            self.notes.append(note)
        return self.dense(weight_t)

    def without_blocks(self, why: str) -> "WeightPlan":
        note = f"{quant.NOTE}: float32 (the GGUF's Q4_1/Q8_0 blocks are not used: {why})"
        if self.activations == INT8:
            raise ConfigError(f"--dtype {self.activations}: {why}", "use --dtype float32")
        return replace(self, blocks=None, notes=self.notes + [note])

    def blocks_note(self, made: list, numel: int) -> str:
        """made: the block multipliers; numel: their float32 weights' size."""
        total = numel
        steps, prefill = f"decode and verify steps (1-{quant.MAX_ROWS} rows)", "; prefill uses the float32 copy"
        if self.activations == INT8:  # (quant8.Int8Blocks takes any number of rows, as llama.cpp does)
            steps, prefill = "decode, verify and prefill steps", ""
        return (f"{quant.NOTE}: {self.weights}: {steps} multiply "
                f"{len(made)} of the target's matrices by their GGUF blocks ({sum(m.nbytes for m in made) / 1e6:.0f} MB "
                f"instead of {total * 4 / 1e6:.0f} MB of float32), {made[0].how}{prefill}")


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
    """The plan for a target from its config and GGUF (None: not converted from one)."""
    cpu32 = device == "cpu" and dtype == torch.float32
    plan = WeightPlan(device, dtype, policy, flags, activations, pack=cpu32 and policy.gemm)
    plan.note_gemm_off()
    if activations != FLOAT32 and (gguf is None or not cpu32):
        raise ConfigError(f"--dtype {activations} needs a CPU target converted from a Q4_1/Q8_0 GGUF",
                          "use the embedded default target (--target default), or --dtype float32")
    if gguf is not None and cpu32:
        plan = with_blocks(plan, gguf, cfg)
    plan.fused, why_not = fused.fusable(cfg, device, dtype, policy)
    plan.notes += [why_not] if why_not else []
    if plan.fused:
        plan.attend = fused.extension().has_attend and cfg.head_dim in (64, 128) and {"avx2", "fma"} <= flags
        plan.attend_wide = plan.attend and "avx512f" in flags and policy.attend_isa != "avx2"
    # llama.cpp's numerics keep K/V in float16: half the bytes a decode step's attention reads (~20% of a step
    # at 512 tokens) and half the memory per position. Only where the C++ attention reads the cache (it converts
    # as it loads); decode and verify read the same stored values, so they still agree bit for bit.
    # Where the 16-lane stages have VNNI, K as q8_0 blocks (llama.cpp's -ctk q8_0): the scores become int8 dot
    # products and K reads 72 bytes a position and head instead of 128 (end to end with the shipped draft 1.07x
    # tokens/s on the 2-core Zen 5); its shift from a float32 cache's predictions is of the float16 cache's size.
    if plan.activations == INT8 and plan.attend and "f16c" in flags and policy.kv_f16:
        plan.kv_dtype = torch.float16
        plan.k_q8 = policy.k_q8 and plan.attend_wide and Q8_K_FLAGS <= flags
        if plan.k_q8:
            plan.notes.append("KV cache: K as q8_0 blocks and V float16, as llama.cpp keeps them with -ctk q8_0 (scores "
                              "as int8 dot products; HETERO_SD_KV=float16 keeps K in float16)")
        else:
            plan.notes.append("KV cache: float16, as llama.cpp keeps it (half the bytes per position; HETERO_SD_KV=float32 "
                              "keeps float32)" + ("; K as q8_0 blocks would need AVX512-VNNI" if policy.k_q8 else ""))
    return plan


Q8_K_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni", "f16c"})


def kv_name(plan: WeightPlan) -> str:
    """The K/V cache in stats and the cost key."""
    return "q8_0 K + float16 V cache" if plan.k_q8 else "float16 KV cache"


def with_blocks(plan: WeightPlan, gguf, cfg) -> WeightPlan:
    if not plan.policy.quant and plan.activations == FLOAT32:
        plan.notes.append(f"{quant.NOTE}: float32 ({plan.policy.why()}; "
                          "the GGUF's blocks are not used)")
        return plan
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
    return replace(plan, blocks=rows) if rows else plan
