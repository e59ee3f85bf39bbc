"""`--draft auto` (published target -> draft pairs, resolved through a local hub cache) and the chat
template controls (system prompt, chat_template_kwargs) in the API and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hetero_sd
from hetero_sd.errors import ConfigError, InvalidArgumentError
from hetero_sd.loading.pairs import PAIRS, auto_draft, model_name, published_draft
from hetero_sd.models.config import ArchConfig, read_json
from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft

from .test_sources import SHA, offline_generate


@pytest.mark.parametrize("spec,name", [
    ("Qwen/Qwen3-8B", "Qwen3-8B"),
    ("/models/Qwen3.5-27B", "Qwen3.5-27B"),
    ("/home/u/.cache/huggingface/hub/models--openai--gpt-oss-20b/snapshots/abc", "gpt-oss-20b"),
    ("/m/Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B"),
    ("/m/gpt-oss-20b.Q8_0.gguf", "gpt-oss-20b"),
    ("/m/Qwen3.5-35B-A3B-UD-IQ2_XXS.gguf", "Qwen3.5-35B-A3B"),
    ("/m/Llama-3.1-8B-Instruct-BF16.gguf", "Llama-3.1-8B-Instruct"),
])
def test_a_target_spec_names_its_model(spec, name):
    assert model_name(spec) == name


def test_known_targets_find_their_published_drafts():
    assert published_draft("Qwen/Qwen3-8B") == "z-lab/Qwen3-8B-DFlash-b16"
    assert published_draft("/m/qwen3.5-9b-Q6_K.gguf") == "z-lab/Qwen3.5-9B-DFlash"  # case-insensitive
    assert published_draft("/m/gpt-oss-120b") == "z-lab/gpt-oss-120b-DFlash"
    assert published_draft("acme/unknown-7b") is None
    assert all(d.startswith("z-lab/") for d in PAIRS.values())
    with pytest.raises(ConfigError, match="no published DFlash draft is known for target 'acme/unknown-7b'"):
        auto_draft("acme/unknown-7b")


def test_draft_auto_resolves_a_known_target_from_the_local_hub_cache(tmp_path, tiny_qwen3):
    cfg = ArchConfig.from_dict(read_json(tiny_qwen3 / "config.json"))
    raw = draft_config(cfg, num_layers=1, block_size=4, mask_token_id=3, layer_ids=[0, 2, 3])
    draft = write_draft(tmp_path / "draft", raw, random_draft_tensors(raw), dtype=torch.float32)
    # a tiny stand-in under the real names
    repos = {"Qwen/Qwen3-8B": tiny_qwen3, "z-lab/Qwen3-8B-DFlash-b16": draft}
    draft_path, notes, drafts = offline_generate(tmp_path / "hub", repos, "'Qwen/Qwen3-8B', 'auto', block_size=4", 5,
                                                 "rt.info['draft'], rt.info['notes'], g.stats.num_drafts")
    assert draft_path.endswith(f"models--z-lab--Qwen3-8B-DFlash-b16/snapshots/{SHA}")
    assert any("draft 'auto': z-lab/Qwen3-8B-DFlash-b16" in n for n in notes) and drafts > 0


# A template that spells its inputs in the tiny vocabulary: t40 system, t41 user, t42 "no thinking"
# (no word starting with t1 or t3: the tokenizer's special tokens t1/t3 match inside words).
TEMPLATE = ("{% for m in messages %}{{ 't40' if m['role'] == 'system' else 't41' }} {{ m['content'] }} {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}t42{% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path_factory.mktemp("tpl") / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_system_prompt_and_template_kwargs_reach_the_template(templated):
    rt = hetero_sd.load(str(templated), None)
    assert rt.encode("t20")[0] == [41, 20]
    with_options = hetero_sd.load(str(templated), None, system_prompt="t50",
                                  chat_template_kwargs={"enable_thinking": False})
    assert with_options.encode("t20")[0] == [40, 50, 41, 20, 42]
    g = rt.generate("t20", max_new_tokens=2, system_prompt="t51", chat_template_kwargs={"enable_thinking": False})
    assert g.prompt_ids == [40, 51, 41, 20, 42]
    g = with_options.generate("t20", max_new_tokens=2, chat_template_kwargs={})  # a call's own replace the runtime's
    assert g.prompt_ids == [40, 50, 41, 20]
    unused = rt.generate("t20", max_new_tokens=1, chat_template_kwargs={"reasoning_effort": "low"})
    assert any("['reasoning_effort'] are not read by this model's chat template" in n for n in unused.stats.notes)


@pytest.mark.parametrize("kwargs,match", [
    (dict(chat_template_kwargs="enable_thinking=false"), "chat_template_kwargs must be a dict"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), "may not set add_generation_prompt"),
    (dict(system_prompt=3), "system_prompt must be a string"),
])
def test_bad_template_options_are_refused_before_loading(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        hetero_sd.load("/nonexistent/never-read", None, **kwargs)


def test_cli_bad_json_is_one_line_naming_the_flag(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "generate", "hi", "--target", str(tmp_path),
                          "--chat-template-kwargs", "{enable_thinking: false}"],
                         env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "--chat-template-kwargs '{enable_thinking: false}' is not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr
