"""Drift is measured over real draft blocks (and never reported over none), a draft runs in the dtype it is
stored in, `--json`/`--trace` never replace a symlink or a special file, the reference package lives apart
from the venv's packages."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

import hetero_sd
from hetero_sd.backends import torch_backend as tb
from hetero_sd.backends.drift import Drift
from hetero_sd.cli.bench import drift_line
from hetero_sd.cli.common import write_json
from hetero_sd.errors import OutputPathError
from hetero_sd.validate import output_file


# --- drift ------------------------------------------------------------------------------------------------
def test_no_block_gives_no_drift_figure():
    d = Drift("ane-sim").to_dict()
    assert d["blocks"] == 0 and d["cosine"] is None and d["top1_agreement"] is None and d["kl"] is None
    assert "no draft block ran" in d["note"] and "no draft block ran" in Drift("ane-sim").summary()
    line = drift_line(d | {"tau_ratio": None})
    assert "no draft block ran" in line and "cosine" not in line


def test_bench_drift_is_measured_on_real_blocks_even_when_the_controller_decodes_plainly(
        tmp_path, tiny_llama, tiny_draft, monkeypatch, capsys):
    """The controller forced to decode plainly (every step a plain one): the row runs no block, the
    drift pass still compares >= 10 real blocks, and says what the row itself did."""
    from hetero_sd.cli import main
    from hetero_sd.decoding import controller

    monkeypatch.setattr(controller.AutoBlock, "choose", lambda self: controller.PLAIN)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t12"}\n{"prompt": "t20 t7"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--draft-device", "ane-sim",
                 "--prompts", str(prompts), "--max-new-tokens", "24", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tau"] == pytest.approx(1.0)  # the row: plain steps only
    drift = res["drift"]
    assert drift["blocks"] >= 10 and drift["cosine"] >= 0.999 and drift["tau_reference"] > 0
    assert drift["in_row"]["blocks"] == 0 and drift["in_row"]["cosine"] is None
    printed = capsys.readouterr().out
    assert "over" in printed and "in the row itself no draft block ran" in printed.replace("\n", " ")


# --- the draft's dtype ------------------------------------------------------------------------------------
def test_a_draft_runs_in_the_dtype_it_is_stored_in(monkeypatch):
    monkeypatch.setattr(tb, "native_bf16", lambda: True)
    assert tb.default_draft_dtype("cpu", torch.float32, torch.float32) == torch.float32
    assert tb.default_draft_dtype("cpu", torch.float32, torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(tb, "native_bf16", lambda: False)
    assert tb.default_draft_dtype("cpu", torch.float32, torch.bfloat16) == torch.float32  # exact upcast


@pytest.fixture(scope="module")
def bf16_draft(tmp_path_factory, tiny_llama):
    from hetero_sd.models.config import ArchConfig, read_json
    from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft

    cfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(cfg, num_layers=1, block_size=4, mask_token_id=3, layer_ids=[0, 3])
    return write_draft(tmp_path_factory.mktemp("bf16-draft"), raw, random_draft_tensors(raw, std=0.2),
                       dtype=torch.bfloat16)


def test_on_a_native_bf16_cpu_a_float32_checkpoint_stays_float32(monkeypatch, tiny_llama, tiny_draft, bf16_draft):
    monkeypatch.setattr(tb, "native_bf16", lambda: True)
    f32 = hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed")
    assert f32.info["draft_dtype"] == "float32"
    bf16 = hetero_sd.load(str(tiny_llama), str(bf16_draft), block_size="fixed")
    assert bf16.info["draft_dtype"] == "bfloat16"
    asked = hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed", draft_dtype="bfloat16")
    assert asked.info["draft_dtype"] == "bfloat16"


# --- output files -----------------------------------------------------------------------------------------
def test_json_replaces_a_regular_file_and_writes_through_a_symlink(tmp_path):
    regular = tmp_path / "out.json"
    regular.write_text("old")
    write_json(str(regular), {"a": 1})
    assert json.loads(regular.read_text()) == {"a": 1}
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    write_json(str(link), {"b": 2})
    assert link.is_symlink() and json.loads(real.read_text()) == {"b": 2}


def test_json_writes_into_a_fifo_instead_of_replacing_it(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    output_file(str(fifo), "--json")
    write_json(str(fifo), {"c": 3})
    reader.join(10)
    assert json.loads(got[0]) == {"c": 3}
    assert fifo.is_fifo()


def test_a_dangling_symlink_is_refused_by_name(tmp_path):
    link = tmp_path / "dangling.json"
    link.symlink_to(tmp_path / "nowhere" / "x.json")
    for check in (lambda: output_file(str(link), "--json"), lambda: write_json(str(link), {})):
        with pytest.raises(OutputPathError) as e:
            check()
        assert "dangling.json" in e.value.problem and "does not exist" in e.value.problem
    assert link.is_symlink()


# --- the reference package ----------------------------------------------------------------------------------
def test_the_makefile_installs_the_reference_apart_from_the_venv():
    """pip prints `ERROR: pip's dependency resolver ...` on every install once dflash's pins sit in the
    venv: the Makefile installs it with --target into $(VENV)/reference, after everything else."""
    from pathlib import Path

    make = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    line = next(x for x in make.splitlines() if "dflash==" in x)
    assert "--no-deps" in line and "--target $(VENV)/reference" in line
    assert make.index("dflash==") > make.index('-e ".[dev]"')


def test_the_sweep_table_says_when_no_block_ran():
    from hetero_sd.bench.experiments import fmt

    assert fmt(Drift("ane-sim").to_dict() | {"tau_ratio": None}) == "no draft block ran"
    assert fmt({"cosine": 0.9991, "tau_ratio": 1.0}) == "cos 0.9991, tau x1.000"


def test_the_chat_panel_and_stats_say_when_no_block_ran():
    from hetero_sd.decoding.stats import Stats
    from hetero_sd.tui.conversation import panel_text

    stats = Stats(mode="speculative")
    stats.drift = Drift("ane-sim")
    text = panel_text(stats, {}, None, {"schedule": "sequential", "temperature": 0.0}).plain
    assert "no draft block ran" in text and "cos 0.0" not in text
    assert stats.to_dict()["drift"]["cosine"] is None
