"""The drafts shipped for the embedded default target: "default" (loads with no flags; until a trained
default ships, "default" means "cpu-trained") and "cpu-trained" (the draft trained on this project's CPU): each loads, accepts more than an untrained
draft would, and stays lossless."""

from __future__ import annotations

from importlib import resources

import pytest

import hetero_sd
from hetero_sd.errors import ConfigError
from hetero_sd.loading.loader import SHIPPED_DRAFTS

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash table is.", "List three uses of magnets."]
MIN_TAU = {"default": 1.5, "cpu-trained": 1.2}  # an untrained draft gives 1.0


def shipped(name: str) -> bool:
    return resources.files("hetero_sd.data").joinpath("drafts", SHIPPED_DRAFTS[name], "config.json").is_file()


@pytest.fixture(scope="module", params=list(SHIPPED_DRAFTS))
def runtime(request, default_folder):
    if not shipped(request.param):
        pytest.skip(f"no {request.param!r} draft ships in this checkout")
    return request.param, hetero_sd.load("default", request.param, block_size="fixed")  # tau at its own fixed block


@pytest.mark.slow
def test_shipped_draft_loads_and_says_what_it_is(runtime):
    name, rt = runtime
    assert rt.draft is not None and rt.info["draft"].endswith(SHIPPED_DRAFTS[name])
    if name == "cpu-trained":
        # the note gives the shipped held_out.json's figures (simulated decoding), not a teacher-forced tau
        note = next(n for n in rt.notes if n.startswith("draft 'cpu-trained'"))
        assert "first guess is right" in note and "% of the time on chat" in note
    else:
        assert rt.notes == []


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_shipped_draft_is_lossless_and_accepts(runtime, prompt):
    name, rt = runtime
    spec = rt.generate(prompt, max_new_tokens=64)
    base = rt.generate(prompt, max_new_tokens=64, speculative=False)
    assert spec.token_ids == base.token_ids
    assert spec.stats.tau > MIN_TAU[name]


@pytest.mark.slow
def test_no_flags_load_the_best_shipped_draft_under_the_controller(default_folder):
    rt = hetero_sd.load()
    best = "default" if shipped("default") else "cpu-trained"
    assert rt.draft is not None and rt.info["draft"].endswith(SHIPPED_DRAFTS[best]) and rt.block == "auto"
    out = rt.generate(PROMPTS[0], max_new_tokens=32)
    assert out.token_ids == rt.generate(PROMPTS[0], max_new_tokens=32, speculative=False).token_ids
    assert out.stats.controller is not None and sum(out.stats.tokens_by_mode.values()) == len(out.token_ids)


def test_cpu_trained_draft_refuses_another_target(tiny_llama):
    with pytest.raises(ConfigError, match="belongs to the default target"):
        hetero_sd.load(str(tiny_llama), "cpu-trained")
