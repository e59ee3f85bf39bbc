"""Model sources: hub ids through a huggingface-hub cache we build here, and the embedded default."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hetero_sd.loading.default_model import default_target_folder

SHA = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, repo_id: str, folder) -> None:
    """The on-disk layout huggingface-hub itself writes: refs/main -> snapshots/<sha>/<files>."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / SHA)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)


def run_offline(cache, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def offline_generate(cache, repos: dict, load_args: str, max_new_tokens: int, fields: str) -> list:
    """The `repos` (hub id -> folder) put in the hub cache `cache`; then, in a Python run offline on it,
    rt = hetero_sd.load(load_args) and g = rt.generate([5, 6, 7], ...): the values of `fields` (a Python
    list's items), as JSON. The run must succeed."""
    for repo_id, folder in repos.items():
        fake_hub_cache(cache, repo_id, folder)
    out = run_offline(cache, f"import hetero_sd, json; rt = hetero_sd.load({load_args}); "
                             f"g = rt.generate([5, 6, 7], max_new_tokens={max_new_tokens}); "
                             f"print(json.dumps([{fields}]))")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hub_ids_resolve_through_the_local_cache(tmp_path, tiny_llama, tiny_draft):
    repos = {"acme/tiny-llama": tiny_llama, "acme/tiny-llama-dflash": tiny_draft}
    target, draft, ids = offline_generate(tmp_path, repos, "'acme/tiny-llama', 'acme/tiny-llama-dflash'", 6,
                                          "rt.info['target'], rt.info['draft'], g.token_ids")
    assert target.endswith(f"models--acme--tiny-llama/snapshots/{SHA}")
    assert draft.endswith(f"models--acme--tiny-llama-dflash/snapshots/{SHA}")
    assert len(ids) == 6


def test_uncached_hub_id_offline_says_how_to_fix(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "generate", "hi", "--target", "acme/absent"],
                         env=dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "not in the local hub cache and HF_HUB_OFFLINE is set" in out.stderr
    assert "hetero-sd fetch acme/absent" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_default_model_is_converted_once_into_an_hf_folder(default_folder):
    config = json.loads((default_folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    assert (default_folder / "model.safetensors").is_file()
    tokenizer_config = (default_folder / "tokenizer_config.json").read_text()
    template = (default_folder / "chat_template.jinja")
    assert "im_start" in (template.read_text() if template.is_file() else tokenizer_config)
    before = (default_folder / "model.safetensors").stat().st_mtime_ns
    assert default_target_folder() == default_folder
    assert (default_folder / "model.safetensors").stat().st_mtime_ns == before
