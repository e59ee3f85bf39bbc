"""A block shorter than the draft's own size (the block-size controller drafts 2..B) is drafted the way the
draft was trained: all B rows, the first predictions kept, for a draft trained at its block size only
(z-lab's; the reference always drafts full blocks); its own rows for one trained on short blocks too
(`dflash_config.short_blocks`, written by train-draft --short-blocks). Every draft backend applies it."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from hetero_sd import load
from hetero_sd.errors import ConfigError
from hetero_sd.models.config import DraftConfig

PROMPT = [1, 5, 9, 2, 7, 4, 8]
DEVICES = ["cpu", "ane-sim"] + (["mlx"] if importlib.util.find_spec("mlx") else [])


def with_short_blocks(folder, tmp_path, value=True):
    copy = shutil.copytree(folder, tmp_path / f"short-{value}")
    raw = json.loads((copy / "config.json").read_text())
    raw["dflash_config"]["short_blocks"] = value
    (copy / "config.json").write_text(json.dumps(raw))
    return copy


def blocks(tiny_llama, draft, device):
    rt = load(str(tiny_llama), str(draft), draft_device=device, block_size="fixed")
    rt.draft.add_context(rt.target.forward(PROMPT).features)
    full = rt.draft.propose(11)
    return full, {size: rt.draft.propose(11, size=size) for size in range(2, rt.draft.block_size)}


@pytest.mark.parametrize("device", DEVICES)
def test_a_draft_trained_at_its_size_drafts_short_blocks_as_full_ones(tiny_llama, tiny_draft, tmp_path, device):
    full, short = blocks(tiny_llama, tiny_draft, device)
    for size, logits in short.items():
        assert logits.shape[0] == size - 1
        # the same rows; the head multiplies fewer of them (another GEMM shape: float rounding only)
        torch.testing.assert_close(logits, full[:size - 1], rtol=1e-5, atol=1e-5)
    trained_full, trained_short = blocks(tiny_llama, with_short_blocks(tiny_draft, tmp_path), device)
    torch.testing.assert_close(trained_full, full, rtol=1e-5, atol=1e-5)  # a full block: the same either way
    for size, logits in trained_short.items():  # its own rows: the cut mask rows were in the full block's attention
        assert logits.shape[0] == size - 1 and not torch.allclose(logits, full[:size - 1], atol=1e-4)


def test_a_short_trained_draft_is_the_same_short_block_on_every_backend(tiny_llama, tiny_draft, tmp_path):
    folder = with_short_blocks(tiny_draft, tmp_path)
    reference = blocks(tiny_llama, folder, "cpu")[1]
    for device in DEVICES[1:]:
        for size, logits in blocks(tiny_llama, folder, device)[1].items():
            torch.testing.assert_close(logits, reference[size], rtol=2e-2, atol=2e-2)  # ane-sim: fp16


def test_the_format_key_is_named_and_checked(tiny_draft, tmp_path):
    assert not DraftConfig.from_folder(tiny_draft).format.short_blocks
    fmt = DraftConfig.from_folder(with_short_blocks(tiny_draft, tmp_path)).format
    assert fmt.short_blocks and fmt.describe() == "dflash; trained for short blocks"
    assert fmt.block_rows(2, 8) == 2 and DraftConfig.from_folder(tiny_draft).format.block_rows(2, 8) == 8
    with pytest.raises(ConfigError, match="short_blocks is 'yes', not true or false"):
        DraftConfig.from_folder(with_short_blocks(tiny_draft, tmp_path, "yes"))
