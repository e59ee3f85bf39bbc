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


@pytest.mark.parametrize("acceptance", ["device", "host"])
def test_bench_accepts_where_asked(tmp_path, tiny_llama, tiny_draft, acceptance):
    out = tmp_path / "out.json"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--dataset", "chat", "--limit", "1",
                 "--max-new-tokens", "8", "--block-size", "fixed", "--acceptance", acceptance, "--json", str(out)])
    res = json.loads(out.read_text())
    assert code == 0 and res["lossless"] and [p["acceptance"] for p in res["prompts"]] == [acceptance]


def test_the_command_line_starts_without_the_web_stack_or_the_chat_app():
    """A GPU machine's image has torch and transformers, not FastAPI, uvicorn or Textual: bench and generate must
    start there (every subcommand's parser is built at start; the server and the app load when run)."""
    code = ("import sys\n"
            "for name in ('fastapi', 'uvicorn', 'starlette', 'pydantic', 'textual', 'llguidance'): sys.modules[name] = None\n"
            "from hetero_sd.cli.main import main\n"
            "sys.exit(main(['bench', '--help']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--acceptance" in out.stdout, out.stderr[-2000:]


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


def write_prompts(tmp_path, n: int = 3):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "t{5 + i} t{9 + i} t{3 + i}"}}\n' for i in range(n)))
    return prompts


def test_bench_runs_placements_and_temperatures_in_one_invocation(tmp_path, tiny_llama, tiny_draft, capsys):
    out = tmp_path / "m.json"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--prompts",
                 str(write_prompts(tmp_path, 2)), "--max-new-tokens", "10", "--placements", "cpu/cpu,cpu/ane-sim",
                 "--temperature", "0,1", "--seed", "3", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is False and len(doc["runs"]) == 4
    assert [(m["draft_device"], m["temperature"]) for m in doc["matrix"]] == [
        ("cpu", 0.0), ("cpu", 1.0), ("ane-sim", 0.0), ("ane-sim", 1.0)]
    for run, m in zip(doc["runs"], doc["matrix"]):
        assert m["lossless"] is (True if m["temperature"] == 0 else None)
        assert len(run["prompts"]) == 2 and run["settings"]["temperature"] == m["temperature"]
    assert "drift" in doc["runs"][2] and "drift" not in doc["runs"][0]
    assert "every placement and temperature" in capsys.readouterr().out


def test_bench_says_where_rejection_compares_other_samples(tmp_path, tiny_llama, tiny_draft, capsys):
    """At T>0 under `rejection` a speculative answer is another sample than the baseline's: said on the screen and
    in the T>0 run's notes, not in the T=0 run's (where both rules give the target's own tokens)."""
    out = tmp_path / "r.json"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--prompts",
                 str(write_prompts(tmp_path, 1)), "--max-new-tokens", "6", "--temperature", "0,1", "--rule", "rejection",
                 "--json", str(out)])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    said = [[n for n in run["notes"] if "other samples" in n] for run in runs]
    assert [len(s) for s in said] == [0, 1]
    assert "other samples" in capsys.readouterr().err


def test_bench_interrupted_keeps_the_finished_rows(tmp_path, tiny_llama, tiny_draft, monkeypatch):
    """Ctrl-C during the second prompt of the second run: the first run and the second run's first
    prompt are in the JSON, marked interrupted, and the exit status says so."""
    import hetero_sd.bench.runner as bench

    real, calls = bench.run_bench, []

    def interrupt_second_run(*args, progress=None, **kw):
        calls.append(1)

        def tick(r):
            progress(r)
            if len(calls) == 2 and r["index"] == 0:
                raise KeyboardInterrupt
        return real(*args, progress=tick, **kw)

    monkeypatch.setattr(bench, "run_bench", interrupt_second_run)
    out = tmp_path / "i.json"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--prompts",
                 str(write_prompts(tmp_path, 3)), "--max-new-tokens", "8", "--temperature", "0,1", "--seed", "1",
                 "--json", str(out)])
    assert code == 130
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["planned_runs"] == 2
    assert [len(r["prompts"]) for r in doc["runs"]] == [3, 1]
    assert doc["runs"][1]["interrupted"] is True and doc["runs"][0]["lossless"] is True
