"""The shipped draft for the embedded default target: loads with no flags, accepts, stays lossless."""

from __future__ import annotations

from importlib import resources

import pytest

import hetero_sd

SHIPPED = resources.files("hetero_sd.data").joinpath("drafts", "SmolLM2-135M-Instruct", "config.json")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SHIPPED.is_file(), reason="no default draft shipped in this checkout")]
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash table is.", "List three uses of magnets."]


@pytest.fixture(scope="module")
def runtime(default_folder):
    return hetero_sd.load()  # target "default", draft "default"


def test_default_pair_loads_the_shipped_draft(runtime):
    assert runtime.draft is not None and runtime.notes == []
    assert runtime.info["draft"].endswith("SmolLM2-135M-Instruct")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_shipped_draft_is_lossless_and_accepts(runtime, prompt):
    spec = runtime.generate(prompt, max_new_tokens=64)
    base = runtime.generate(prompt, max_new_tokens=64, speculative=False)
    assert spec.token_ids == base.token_ids
    assert spec.stats.tau > 1.5  # an untrained draft gives 1.0
