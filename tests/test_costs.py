"""The cost probe: its shape, its JSON and that it leaves the caches as it found them (no timings checked)."""

from __future__ import annotations

import json

from hetero_sd.decoding.costs import Costs, measure_costs
from hetero_sd.runtime import load


def test_costs_shape_json_and_caches(tiny_llama, tiny_draft):
    rt = load(str(tiny_llama), str(tiny_draft))
    rt.target.forward([5, 6, 7])
    rt.draft.add_context(rt.target.forward([8]).features)
    before = (rt.target.length, rt.draft.context_length)
    costs = measure_costs(rt.target, rt.draft, context=32, ks=(1, 4), blocks=(4, 8), repeats=2, machine=True)
    assert (rt.target.length, rt.draft.context_length) == before
    assert costs.decode_s > 0 and set(costs.verify_s) == {1, 4} and set(costs.draft_s) == {4}
    assert any("block 8 skipped" in n for n in costs.notes)  # the tiny draft's block size is 6
    assert costs.peak_gflops > 0 and costs.bandwidth_gbs > 0 and costs.context == 32
    assert costs.floors_s["verify"][4] > 0 and costs.floors_s["draft"][4] > 0
    doc = json.loads(json.dumps({"costs": costs.to_json()}))
    assert set(doc["costs"]["verify_s"]) == {"1", "4"}
    assert Costs.from_json(doc) == costs and Costs.from_json(doc["costs"]) == costs


def test_costs_without_draft(tiny_llama):
    rt = load(str(tiny_llama), None)
    costs = measure_costs(rt.target, None, context=16, ks=(2,), repeats=1)
    assert rt.target.length == 0 and costs.draft_s == {} and costs.peak_gflops is None


def test_compute_floor_uses_the_models_own_int8_kernel(smollm_random, tiny_llama):
    """The default target multiplies int8 rows by GGUF blocks: its compute floor is that kernel's measured
    peak, recorded by name; a float32 target's is the dense matmul's peak (no kernel peak recorded)."""
    from hetero_sd.backends.base import weights_of
    from hetero_sd.decoding.costs import own_peak

    costs = Costs(decode_s=1.0, verify_s={}, draft_s={}, peak_gflops=1.0)
    peak = own_peak(costs, "target", weights_of(smollm_random.target))
    assert peak > 1e9 and costs.kernel_peak_gops == {"target": peak / 1e9}
    dense = Costs(decode_s=1.0, verify_s={}, draft_s={}, peak_gflops=123.0)
    assert own_peak(dense, "target", weights_of(load(str(tiny_llama), None).target)) == 123e9
    assert dense.kernel_peak_gops == {}
