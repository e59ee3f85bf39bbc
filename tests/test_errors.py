"""Bad input gets one clear error naming the problem and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hetero_sd
from hetero_sd.cli import main
from hetero_sd.models.config import ArchConfig, read_json
from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft
from hetero_sd.errors import (ConfigError, DeviceUnavailableError, MismatchError, ModelNotFoundError,
                              PromptTooLongError, UnknownDeviceError, WeightsError)

from .conftest import make_tiny_target


def draft_for(target_folder, out, **kw):
    cfg = ArchConfig.from_dict(read_json(target_folder / "config.json"))
    raw = draft_config(cfg, num_layers=1, block_size=4, mask_token_id=3, layer_ids=kw.pop("layer_ids", [0, 3]))
    raw.update(kw)
    return write_draft(out, raw, random_draft_tensors(raw))


def test_hidden_size_mismatch(tmp_path, tiny_draft):
    narrow = make_tiny_target(tmp_path / "narrow", hidden_size=32, head_dim=8)
    with pytest.raises(MismatchError, match="hidden size 64 != target hidden size 32"):
        hetero_sd.load(str(narrow), str(tiny_draft))


def test_vocab_mismatch(tmp_path, tiny_draft):
    small = make_tiny_target(tmp_path / "small", vocab_size=32)
    with pytest.raises(MismatchError, match="vocab size 64 != target vocab size 32"):
        hetero_sd.load(str(small), str(tiny_draft))


def test_layer_ids_out_of_range(tmp_path, tiny_llama):
    bad = draft_for(tiny_llama, tmp_path / "d", layer_ids=[0, 9])
    with pytest.raises(MismatchError, match=r"target layers \[9\].*only 4 layers"):
        hetero_sd.load(str(tiny_llama), str(bad))


def test_target_layer_count_mismatch(tmp_path, tiny_llama):
    bad = draft_for(tiny_llama, tmp_path / "d", num_target_layers=36)
    with pytest.raises(MismatchError, match="36-layer target"):
        hetero_sd.load(str(tiny_llama), str(bad))


def test_not_a_draft(tiny_llama):
    with pytest.raises(ConfigError, match="not a DFlash draft"):
        hetero_sd.load(str(tiny_llama), str(tiny_llama))


def test_corrupt_weights(tmp_path, tiny_llama):
    broken = shutil.copytree(tiny_llama, tmp_path / "broken")
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        hetero_sd.load(str(broken), None)


def test_missing_weights(tmp_path, tiny_llama):
    empty = shutil.copytree(tiny_llama, tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors"):
        hetero_sd.load(str(empty), None)


def draft_without(target_folder, out, tensor: str):
    from safetensors.torch import load_file, save_file

    folder = draft_for(target_folder, out)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[tensor]
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("tensor", ["layers.0.mlp.down_proj.weight", "fc.weight"])
def test_draft_missing_a_tensor(tmp_path, tiny_llama, tensor):
    folder = draft_without(tiny_llama, tmp_path / "d", tensor)
    with pytest.raises(WeightsError, match=f"no tensor '{tensor}'"):
        hetero_sd.load(str(tiny_llama), str(folder))


def test_config_not_json(tmp_path, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path / "cfg")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        hetero_sd.load(str(folder), None)


def test_unsupported_architecture(tmp_path, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path / "arch")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        hetero_sd.load(str(folder), None)


def test_unknown_device(tiny_llama):
    with pytest.raises(UnknownDeviceError, match="unknown device 'tpu'"):
        hetero_sd.load(str(tiny_llama), None, target_device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_absent_device(tiny_llama, tiny_draft):
    with pytest.raises(DeviceUnavailableError, match="not present on this machine"):
        hetero_sd.load(str(tiny_llama), str(tiny_draft), draft_device="cuda")


def test_missing_model():
    with pytest.raises(ModelNotFoundError, match="not a folder, a .gguf file or a hub id"):
        hetero_sd.load("./no/such/model", None)


def test_prompt_too_long(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft))
    with pytest.raises(PromptTooLongError, match="target's context is 512"):
        rt.generate([5] * 600, max_new_tokens=8)
    with pytest.raises(PromptTooLongError, match="lower max_new_tokens"):
        rt.generate([5] * 300, max_new_tokens=300)


def test_cli_prints_one_line_error_without_traceback(capsys, tiny_llama):
    code = main(["generate", "t5 t6", "--target", str(tiny_llama), "--draft-device", "tpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: unknown device 'tpu'" in err and "fix: use one of" in err
    assert "Traceback" not in err

