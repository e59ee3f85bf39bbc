"""The command line, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetero_sd.cli import main


def test_bench_writes_the_documented_json(tmp_path, tiny_llama, tiny_draft, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5 t6 t7"}\n{"turns": ["t9 t10", "t11"]}\n{"prompt": "t20 t4"}\n')
    out = tmp_path / "out.json"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--prompts", str(prompts),
                 "--limit", "2", "--max-new-tokens", "12", "--json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    for key in ("tau", "speedup", "baseline_tokens_per_s", "spec_tokens_per_s", "lossless", "prompts",
                "machine", "models", "acceptance_rate_per_position"):
        assert key in res
    assert res["lossless"] is True and len(res["prompts"]) == 2
    assert res["prompts"][1]["prompt"] == "t9 t10"
    assert "autoregressive baseline vs DFlash" in capsys.readouterr().out


def test_devices_lists_the_cpu(capsys):
    assert main(["devices"]) == 0
    assert "cpu" in capsys.readouterr().out


@pytest.mark.slow
def test_generate_answers_from_the_default_model(default_folder):
    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "generate", "Write a haiku about the sea",
                          "--max-new-tokens", "24"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) >= 5
    assert "tok/s" in out.stderr
