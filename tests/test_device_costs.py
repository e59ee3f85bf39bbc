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
