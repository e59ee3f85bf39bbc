"""The weight plan (backends/torch_backend/plan.py) is the whole of a target's choices, made before any module is
built: each matrix's format, the layer's ops, the K/V cache, and the notes that say so. It is frozen (its blocks a
read-only mapping, its notes a tuple): the modules only read it, so the plan a target was built on is, field for
field, the one `plan_target` returned, and the one the stats name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hetero_sd
from hetero_sd.backends.torch_backend import quant8, target
from hetero_sd.backends.torch_backend.plan import WeightPlan


def snapshot(plan: WeightPlan) -> dict:
    """Every field's value; the GGUF blocks by kind, shape and the identity of their arrays."""
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    if plan.blocks is not None:
        fields["blocks"] = {key: (kind, rows.shape, id(rows)) for key, (kind, rows) in plan.blocks.items()}
    return fields


def assert_frozen(plan: WeightPlan) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pack = not plan.pack
    with pytest.raises(AttributeError):
        plan.notes.append("a note written after the plan was made")
    if plan.blocks is not None:
        with pytest.raises(TypeError):
            plan.blocks["lm_head"] = None


def load_watching_the_plan(monkeypatch, *args, **kwargs):
    """hetero_sd.load, with each plan plan_target returns kept as it was returned: [(plan, its snapshot)]."""
    made = []

    def planned(*a, **k):
        plan = plan_target(*a, **k)
        made.append((plan, snapshot(plan)))
        return plan

    plan_target = target.plan_target
    monkeypatch.setattr(target, "plan_target", planned)
    return hetero_sd.load(*args, **kwargs), made


def check_built_on_the_plan(rt, made, prompt) -> WeightPlan:
    (plan, before), = made
    assert rt.target.plan is plan  # the very plan, not a copy settled while the modules were built
    assert_frozen(plan)
    out = rt.generate(prompt, max_new_tokens=8)
    assert out.token_ids and snapshot(plan) == before  # building the target and the draft, and a generation
    assert rt.target.notes == list(plan.notes) and rt.info["weight_plan"] == plan.describe()
    assert all(n in rt.notes for n in plan.notes)  # every note was written before the plan was returned
    return plan


def test_a_float32_target_and_its_draft_are_built_on_the_plan_as_returned(monkeypatch, tiny_llama, tiny_draft):
    rt, made = load_watching_the_plan(monkeypatch, str(tiny_llama), str(tiny_draft), block_size=4)
    plan = check_built_on_the_plan(rt, made, [5, 9, 12, 20, 7])
    assert plan.blocks is None and plan.kv_dtype is None


@pytest.mark.slow
@pytest.mark.skipif(quant8.isa() is None, reason="no AVX512-VNNI nor AVX2+FMA+F16C on this CPU")
def test_the_int8_default_target_and_its_draft_are_built_on_the_plan_as_returned(monkeypatch, default_folder):
    """The int8 target of the GGUF: its blocks, its K/V cache and the note naming its blocks are all in the plan
    before a module is built; the draft, which multiplies the target's head blocks, only reads it."""
    rt, made = load_watching_the_plan(monkeypatch, "default", "default", block_size=4)
    plan = check_built_on_the_plan(rt, made, "Name three colors.")
    assert plan.blocks and plan.activations == "int8" and plan.kv_dtype == torch.float16
    assert plan.notes[-1].startswith("target weights: ") and "x int8 rows" in plan.notes[-1]
    assert f"multiply {1 + 4 * rt.target.config.num_hidden_layers} of the target's matrices" in plan.notes[-1]
    assert isinstance(rt.draft.model.mm_head, quant8.Int8Blocks)  # the head blocks the plan holds
