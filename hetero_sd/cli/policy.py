"""The load policy from the environment: the one place that reads the HETERO_SD_* switches of the weights
and kernels (the backends take a LoadPolicy and read no variables)."""

from __future__ import annotations

import os
from typing import Mapping

from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.backends.torch_backend.steps import MODES
from hetero_sd.errors import ConfigError

OFF = ("off", "0", "no", "false")


def policy_from_env(environ: Mapping[str, str] | None = None) -> LoadPolicy:
    """HETERO_SD_QUANT=off (float32 weights, not the GGUF's blocks), HETERO_SD_FUSED=off (torch ops for
    the layer), HETERO_SD_DRAFT_HEAD=float (the draft multiplies the target's own head),
    HETERO_SD_DRAFT_LAYERS=float (the draft's own matrices in its float dtype, not GGUF blocks times int8 rows;
    =q4_1: Q4_1 blocks, not the default Q8_0), HETERO_SD_DRAFT_VOCAB=off (a reduced-vocabulary draft scores the
    target's whole head), HETERO_SD_KV=float16 (the int8 target's K in float16, not q8_0 blocks where the CPU
    has AVX512-VNNI; V is float16 either way; =float32: K and V in float32), HETERO_SD_STEPS=eager (on a GPU, the
    steps launched op by op instead of replayed as captured CUDA graphs; =fixed: fixed shapes, not captured;
    =compiled: fixed shapes under torch.compile, captured on a GPU)."""
    env = os.environ if environ is None else environ
    given = {k: v for k, v in env.items() if k.startswith("HETERO_SD_") and k in NAMES}
    kv = given.get("HETERO_SD_KV", "q8_0").lower()
    if kv not in ("q8_0", "float16", "float32"):
        raise ConfigError(f"HETERO_SD_KV={given['HETERO_SD_KV']!r} is not a K/V cache type",
                          "use HETERO_SD_KV=q8_0 (the default), float16 or float32")
    layers = given.get("HETERO_SD_DRAFT_LAYERS", "q8_0").lower()
    if layers not in ("q4_1", "q8_0", "int8", "float"):
        raise ConfigError(f"HETERO_SD_DRAFT_LAYERS={given['HETERO_SD_DRAFT_LAYERS']!r} is not a draft layer format",
                          "use q8_0 (the default), q4_1 or float")
    steps = given.get("HETERO_SD_STEPS", "auto").lower()
    if steps not in MODES:
        raise ConfigError(f"HETERO_SD_STEPS={given['HETERO_SD_STEPS']!r} is not a step mode",
                          f"use one of {', '.join(MODES)} (auto: CUDA graphs on a GPU)")
    return LoadPolicy(quant=given.get("HETERO_SD_QUANT", "on").lower() not in OFF,
                      fused=given.get("HETERO_SD_FUSED", "on").lower() not in OFF,
                      draft_int8_head=given.get("HETERO_SD_DRAFT_HEAD", "int8") != "float",
                      draft_int8_layers=layers != "float",
                      draft_layer_blocks="Q4_1" if layers == "q4_1" else "Q8_0",  # ("int8": Q8_0 too)
                      draft_vocab=given.get("HETERO_SD_DRAFT_VOCAB", "on").lower() not in OFF,
                      kv_f16=kv != "float32", k_q8=kv == "q8_0", steps=steps,
                      origin=", ".join(f"{k}={v}" for k, v in sorted(given.items())))


NAMES = ("HETERO_SD_QUANT", "HETERO_SD_FUSED", "HETERO_SD_DRAFT_HEAD", "HETERO_SD_DRAFT_LAYERS",
         "HETERO_SD_DRAFT_VOCAB", "HETERO_SD_KV", "HETERO_SD_STEPS")
