"""What the caller allows the backends to do with a model's weights: a policy object passed to `load()`.

Only the CLI reads the HETERO_SD_* environment variables (hetero_sd/cli/policy.py builds this from them);
the backends never do. The torch backend turns a policy, the device, the dtype, the CPU's flags and the
model's GGUF into one weight plan at load (torch_backend/plan.py), which its stats and notes name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadPolicy:
    quant: bool = True  # a target converted from a GGUF multiplies decode/verify rows by its Q4_1/Q8_0 blocks
    fused: bool = True  # the fused C++ layer ops on a float32 CPU target
    gemm: bool = True  # float32 CPU weights packed for the decoding GEMM kernel (1-64 rows; batched data generation
    #                    multiplies more rows at once and keeps them dense, for torch's matmul)
    draft_int8_head: bool = True  # a CPU draft multiplies the target's head blocks by int8 rows
    draft_int8_layers: bool = True  # ... and then its own matrices too, as GGUF blocks quantized at load:
    draft_layer_blocks: str = "Q8_0"  # ... of this kind ("Q8_0" or "Q4_1": plan.draft_blocks measures both)
    draft_vocab: bool = True  # a draft with a reduced vocabulary (draft_vocab) scores only its K rows; False: all
    kv_f16: bool = True  # an int8-rows CPU target on the C++ attention keeps its K/V cache in float16 (llama.cpp's)
    k_q8: bool = True  # ... and its K as q8_0 blocks (llama.cpp's -ctk q8_0), where the CPU has AVX512-VNNI
    steps: str = "auto"  # decode/verify/draft steps: "graphs" (fixed shapes captured as CUDA graphs), "compiled"
    #                      (fixed shapes under torch.compile, captured on CUDA), "fixed", "eager", or "auto" (graphs
    #                      on CUDA, eager elsewhere): torch_backend/steps.py
    origin: str = ""  # where the choices came from, named in notes (e.g. "HETERO_SD_QUANT=off")

    def why(self) -> str:
        """How a switched-off choice is named in a note."""
        return f"off in the load policy{f' ({self.origin})' if self.origin else ''}"


DEFAULT = LoadPolicy()
