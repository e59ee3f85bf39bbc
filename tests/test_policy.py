"""The load policy (backends/policy.py) is passed down, read from HETERO_SD_* variables only by the CLI
(hetero_sd/cli/policy.py), and turned into one weight plan at load (torch_backend/plan.py), recorded."""

from __future__ import annotations

import pathlib
import re

import pytest

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.cli.policy import policy_from_env
from hetero_sd.errors import ConfigError

BACKENDS = pathlib.Path(__file__).resolve().parents[1] / "backends"


def test_the_cli_reads_the_variables_and_names_them():
    assert policy_from_env({}) == LoadPolicy()
    p = policy_from_env({"HETERO_SD_QUANT": "off", "HETERO_SD_FUSED": "0", "HETERO_SD_DRAFT_HEAD": "float",
                         "HETERO_SD_DRAFT_VOCAB": "off", "HETERO_SD_HOME": "/x"})
    assert (p.quant, p.fused, p.draft_int8_head, p.draft_vocab) == (False, False, False, False)
    assert "HETERO_SD_QUANT=off" in p.why() and "HETERO_SD_HOME" not in p.origin
    with pytest.raises(ConfigError, match="HETERO_SD_KV='f32'"):
        policy_from_env({"HETERO_SD_KV": "f32"})
    assert not policy_from_env({"HETERO_SD_KV": "float32"}).kv_f16 and policy_from_env({}).kv_f16
    assert policy_from_env({}).k_q8 and policy_from_env({"HETERO_SD_KV": "Q8_0"}).k_q8
    assert not policy_from_env({"HETERO_SD_KV": "float16"}).k_q8 and policy_from_env({"HETERO_SD_KV": "float16"}).kv_f16
    assert policy_from_env({}).draft_layer_blocks == "Q8_0"
    for value, int8, kind in (("q4_1", True, "Q4_1"), ("int8", True, "Q8_0"), ("float", False, "Q8_0")):
        p = policy_from_env({"HETERO_SD_DRAFT_LAYERS": value})
        assert (p.draft_int8_layers, p.draft_layer_blocks) == (int8, kind)
    with pytest.raises(ConfigError, match="HETERO_SD_DRAFT_LAYERS='q2'"):
        policy_from_env({"HETERO_SD_DRAFT_LAYERS": "q2"})


def test_no_backend_reads_a_switch_from_the_environment():
    for path in BACKENDS.rglob("*.py"):
        assert not re.search(r"(environ|getenv)[^\n]*HETERO_SD_", path.read_text()), path


def test_the_plan_follows_the_policy_and_is_recorded(tiny_llama):
    full = hetero_sd.load(str(tiny_llama), None)
    bare = hetero_sd.load(str(tiny_llama), None, policy=LoadPolicy(fused=False, gemm=False))
    assert full.info["weight_plan"] == full.target.plan.describe()
    assert "fused layer ops" in full.info["weight_plan"] or any("fused layer ops not used" in n for n in full.notes)
    assert bare.info["weight_plan"] == "float32" and not bare.target.fused
    assert all(callable(m) is False for m in bare.target.matrices())  # dense: torch's matmul on the tensors
    ids = [5, 9, 12, 20, 7]
    assert full.generate(ids, max_new_tokens=12, speculative=False).token_ids == \
        bare.generate(ids, max_new_tokens=12, speculative=False).token_ids


def test_only_the_cli_reads_switches_outside_the_backends_too():
    """Decoding, training, the chat app...: no HETERO_SD_* switch read from the environment outside the CLI
    (hetero_sd/home.py's HETERO_SD_HOME, where the models live, is the library's own setting, like HF_HOME)."""
    root = BACKENDS.parent
    for path in [p for d in ("hetero_sd", "tui", "ane_compiler") for p in (root / d).rglob("*.py")]:
        if "cli" in path.relative_to(root).parts or path.name == "home.py":
            continue
        assert not re.search(r"(environ|getenv)[^\n]*HETERO_SD_", path.read_text()), path
