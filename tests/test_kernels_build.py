"""The native kernels' build (backends/torch_backend/kernels): C++ source files registered as torch custom
ops (the profiler names them), and a build that fails keeps the compiler's whole message."""

from __future__ import annotations

import shutil

import pytest
import torch

from hetero_sd.backends.torch_backend import gemm
from hetero_sd.backends.torch_backend.kernels import HERE, KernelUnavailable, build

needs_compiler = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ toolchain")


def test_every_kernel_is_a_source_file():
    assert sorted(p.name for p in HERE.glob("*.cpp")) == ["fused.cpp", "gemm.cpp", "quant.cpp", "quant8.cpp"]


@needs_compiler
def test_a_failed_build_keeps_the_whole_compiler_message(tmp_path):
    (tmp_path / "broken.cpp").write_text("int first() { return 1; }\nint second() { return not_declared_anywhere; }\n")
    error = build("broken", tmp_path)
    assert isinstance(error, KernelUnavailable)
    assert "not_declared_anywhere" in str(error) and "broken.cpp:2" in str(error)  # the line, not a summary
    assert "not_declared_anywhere" in error.summary and "\n" not in error.summary


@pytest.mark.skipif(gemm.isa() is None, reason="no AVX2/AVX-512 on this CPU")
def test_the_profiler_sees_the_kernels_as_ops():
    packed = gemm.Packed(torch.randn(64, 48))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        packed(torch.randn(8, 64))
    assert "hetero_sd_gemm::gemm" in {e.key for e in prof.key_averages()}
