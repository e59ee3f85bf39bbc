"""torch backend: cpu, cuda, mps."""

from __future__ import annotations

from pathlib import Path

import torch

from hetero_sd.models.config import ArchConfig, DraftConfig
from hetero_sd.models import draft_vocab
from hetero_sd.models.draft_format import read_tensors
from hetero_sd.models.weights import converted_from, load_weights

from hetero_sd.backends.policy import DEFAULT, LoadPolicy

from . import head, plan
from .cpu import cpu_flags, native_bf16
from .draft import TorchDraft
from .module import DraftModule
from .target import TorchTarget

__all__ = ["DraftModule", "TorchDraft", "TorchTarget", "load_target", "load_draft", "default_dtype", "default_draft_dtype", "default_target_numerics", "native_bf16"]


def default_dtype(device: str) -> torch.dtype:
    # The target: float32 on the CPU (bf16 weights are a different target: outside the parity tests'
    # 1e-4 of the float32 model, so only on request); bfloat16 on accelerators.
    return torch.float32 if device == "cpu" else torch.bfloat16


def default_target_numerics(folder: Path, device: str, policy: LoadPolicy = DEFAULT) -> tuple[str, str | None]:
    """'int8' for a CPU target converted from a GGUF (when this CPU has the kernel), else 'float32'; and the
    note that says why the default could not be had (plan.default_activations)."""
    return plan.default_activations(converted_from(folder), device, policy, cpu_flags())


def default_draft_dtype(device: str, target_dtype: torch.dtype, stored: torch.dtype | None = None,
                        int8_rows: bool = False) -> torch.dtype:
    """A draft runs in the dtype it is stored in: a float32 checkpoint stays float32 (rounding it to bf16
    moves its proposals away from the reference's). Beside a CPU target that multiplies int8 rows by its
    GGUF blocks (int8_rows), any draft runs in float32: its matrices then become Q8_0 blocks times int8 rows
    on the same kernels and its layers take the fused ops (draft.py), ~5x cheaper than bf16 matmuls even
    with AVX512-BF16 (Zen 5 EPYC, 2 threads: block of 2 0.22 vs 1.17 ms, of 8 0.43 vs 1.46, `bench --costs`).
    Otherwise a 16-bit draft (the published ones) runs in
    bf16 on a CPU with native bf16 (AMX / AVX512-BF16), and elsewhere follows the target (a lossless upcast).
    stored=None (unknown): as a 16-bit draft."""
    if device == "cpu" and (stored == torch.float32 or int8_rows):
        return torch.float32
    return torch.bfloat16 if device == "cpu" and native_bf16() else target_dtype


def load_target(folder: Path, cfg: ArchConfig, device: str, dtype: torch.dtype, layer_ids=(),
                max_context: int | None = None, activations: str = "float32",
                policy: LoadPolicy = DEFAULT) -> TorchTarget:
    """The target with the weight plan made from `policy` and this CPU's flags (plan.py)."""
    return TorchTarget(cfg, load_weights(folder), folder, device, dtype, layer_ids, max_context, activations,
                       policy, cpu_flags())


def load_draft(folder: Path, cfg: DraftConfig, target, device: str, dtype: torch.dtype,
               mask_token_id: int, tensors: dict | None = None, int8_head: bool = True,
               policy: LoadPolicy = DEFAULT) -> TorchDraft:
    """int8_head=False: the target's own head (a float32 reference that measures another draft's drift
    must not carry the int8 head's rounding); the policy can turn the int8 head off too."""
    tensors = tensors if tensors is not None else read_tensors(folder, cfg)  # either layout (draft_format.py)
    feature_size = len(target.layer_ids) * target.config.hidden_size
    int8, lm_head, ids = int8_head and policy.draft_int8_head, as_torch(target.lm_head), head.vocab_ids(tensors, policy)
    if ids is not None:  # a reduced head: those rows of the target's head (head.py)
        mm, note = head.reduced_blocks(target, ids, lm_head, device, int8)
        note = note or draft_vocab.describe(ids.numel(), lm_head.shape[1])
    else:  # another backend's target (MLX) has no torch head to share: the draft then makes its own
        mm, note = target.head_for(device, dtype, int8) if isinstance(target, TorchTarget) else (None, None)
    return TorchDraft(cfg, tensors, folder, device, dtype, as_torch(target.embed), lm_head, feature_size,
                      mask_token_id, target.max_context, mm, policy=policy, head_note=note, vocab_ids=ids)


def as_torch(x) -> torch.Tensor:
    """The target's shared embedding/head as a torch tensor (another backend's target holds its own arrays)."""
    import numpy as np
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))
