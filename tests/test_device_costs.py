"""What the cost probe and the peers know of the device they measure: a floor names its hardware, and a
transformers peer runs where our target runs, in its dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hetero_sd.bench.peer_row import placement
from hetero_sd.decoding import costs


def test_device_kinds_and_names():
    assert costs.device_kind("cuda:1") == "cuda" and costs.device_kind("ane-sim") == "ane-sim"
    assert costs.accelerator_name("cpu") == "" and costs.accelerator_name("mps") == "Apple GPU (MPS)"


@pytest.mark.parametrize("info,expected", [
    ({"target_device": "cuda:0", "target_dtype": "bfloat16"}, ("cuda:0", torch.bfloat16)),
    ({"target_device": "cpu", "target_dtype": "int8"}, ("cpu", torch.float32)),
    ({"target_device": "mlx", "target_dtype": "float16"}, ("cpu", torch.float16)),
    ({"target_device": "cpu", "target_dtype": "float32"}, ("cpu", torch.float32)),
])
def test_peers_run_on_the_targets_device_and_dtype(info, expected):
    assert placement(SimpleNamespace(info=info)) == expected


def test_a_floor_on_the_cpu_reads_host_bandwidth(monkeypatch):
    monkeypatch.setattr(costs, "read_bandwidth_gb_s", lambda: 12.5)
    monkeypatch.setattr(costs, "device_bandwidth_gb_s", lambda device: pytest.fail("a device copy on the CPU"))
    assert costs.bandwidth_gb_s("cpu") == 12.5


def test_peak_is_measured_on_the_device_asked():
    assert costs.peak_gflops(torch.float32, n=64, repeats=1, device="cpu") > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_floor_is_the_gpus():
    name = costs.accelerator_name("cuda")
    assert name and "Xeon" not in name and "EPYC" not in name
    assert costs.device_bandwidth_gb_s("cuda", buffer_mb=256) > 200  # any GPU's HBM/GDDR, far above a host's copy


def test_an_mlx_floor_is_mlxs(tiny_llama, tiny_draft, monkeypatch):
    """An MLX model's floors: its own weight sizes at MLX's own measured read bandwidth and matmul peak (on Linux
    MLX's CPU build, whose kernels are not torch's), never the host's torch figures under MLX's name."""
    pytest.importorskip("mlx.core")
    from hetero_sd.backends.mlx_backend import probe
    from hetero_sd.runtime import load

    monkeypatch.setattr(costs, "read_bandwidth_gb_s", lambda *a: pytest.fail("the host's torch reads for MLX"))
    monkeypatch.setattr(probe, "bandwidth_gb_s", lambda: 10.0)
    monkeypatch.setattr(probe, "peak_gflops", lambda dtype, n=None, repeats=5: 20.0)
    rt = load(str(tiny_llama), str(tiny_draft), target_device="mlx", draft_device="mlx")
    weight_bytes, params, kv = rt.target.sizes()
    assert weight_bytes == 4 * params and kv > 0  # float32
    got = costs.measure_costs(rt.target, rt.draft, context=32, ks=(1, 4), blocks=(4,), repeats=1, machine=True)
    assert (got.device, got.bandwidth_gbs, got.peak_gflops) == ("MLX", 10.0, 20.0)
    assert got.floors_s["decode"] == pytest.approx(max((weight_bytes + 32 * kv) / 10e9, 2 * params / 20e9))
    assert got.floors_s["draft"][4] > 0


def test_mlxs_probes_measure_through_mlx():
    pytest.importorskip("mlx.core")
    from hetero_sd.backends.mlx_backend import probe

    assert probe.peak_gflops(n=64, repeats=1) > 0 and probe.bandwidth_gb_s(buffer_mb=8, repeats=1) > 0
