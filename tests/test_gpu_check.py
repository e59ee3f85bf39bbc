"""benchmarks/gpu_check.py, run here on a tiny shape on the CPU: a GPU call has no second chance, so every row
it writes is exercised in CI, and its oracle rows double as a lossless check (float32: token-identical to
autoregressive decoding, with fixed-shape and eager steps, both schedules)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_writes_every_row(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert gpu_check.main(["--device", "cpu", "--dtype", "float32", "--cpu-draft-dtype", "float32", "--shapes", "tiny",
                           "--e2e-shapes", "tiny", "--tokens", "10", "--prompt", "12", "--context", "32",
                           "--runs", "1", "--repeats", "1", "--blocks", "4", "--compiled-shapes", "tiny",
                           "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["errors"] == [] and result["skipped"] == []
    tiny = result["shapes"]["tiny"]
    assert {"decode_ms", "floor_ms", "verify_ms", "draft_ms", "captured"} <= set(tiny)
    assert set(tiny["verify_ms"]) == {"1", "2", "4", "8", "16"} and set(tiny["draft_ms"]) == {"2", "4", "8", "16"}
    assert tiny["steps"] == "fixed" and not tiny["captured"] and tiny["eager"]["steps"] == "eager"
    rows = result["e2e"]
    assert rows["tiny/ar/graphs"]["tok_s"] > 0 and rows["tiny/hf-generate"]["same_tokens_as_ours"]
    # the steps compiled (inductor's CPU kernels here): their costs and warm-up, the headline row lossless
    compiled = tiny["compiled"]
    assert compiled["steps"] == compiled["draft_steps"] == "compiled" and compiled["compilations"] > 0
    assert compiled["decode_ms"] > 0 and compiled["warm_s"] > 0 and compiled["warm_steps"] > 0
    assert rows["tiny/oracle-full-b4/cpu/cpu/sequential/compiled"]["identical_to_ar"]
    assert rows["tiny/ar/compiled"]["launches_per_step"]["ops"] > 0
    oracle = {k: v for k, v in rows.items() if "/oracle-" in k and not k.endswith("/compiled")}
    # (full and set acceptance x sequential and overlap, + full acceptance's sequential with host acceptance and
    # both sampled) x fixed and eager steps
    assert len(oracle) == 14
    assert all(v["identical_to_ar"] for k, v in oracle.items() if "-t1" not in k)
    assert {v["identical_to_ar"] for k, v in oracle.items() if "-t1" in k} == {None}
    assert {v["acceptance"] for k, v in oracle.items() if "/sequential-t1/" in k} == {"device"}
    assert {v["acceptance"] for k, v in oracle.items() if "/sequential/" in k} == {"device"}
    assert {v["acceptance"] for k, v in oracle.items() if "/sequential-host-acceptance/" in k} == {"host"}
    assert rows["tiny/oracle-full-b4/cpu/cpu/sequential/graphs"]["tau"] > 3.0
    assert rows["tiny/oracle-right2-b4/cpu/cpu/overlap/eager"]["tau"] <= 3.0
    assert set(tiny["context_ms"]) == {"1", "2", "4", "8", "16"}
    assert tiny["prefill_ms"] > 0 and tiny["eager"]["prefill_ms"] > 0
    assert all("of_prediction" in v and "of_prediction_e2e" in v for k, v in oracle.items() if "/sequential" in k)
    assert all(v["decode_tok_s"] > 0 for v in rows.values())  # the loop's own rate, after the first token
    # RESULTS.md's section reads it as written
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_md
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    page = "\n".join(results_md.gpu_section(tmp_path / "gpu_check.json"))
    assert "| tiny | fixed-shape steps |" in page and "tiny/oracle-full-b4/cpu/cpu/sequential/graphs" in page
    assert "| tiny: verify of 16, decode steps |" in page and "| smollm2-135m: decode step, ms | - |" in page


def test_gpu_check_records_what_the_budget_left_out_and_a_failed_mode(tmp_path, monkeypatch):
    """Out of budget: every row is named in `skipped`, the JSON still written; a mode that raises is an error
    of that mode while the other mode's figures stay."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tiny = ["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--e2e-shapes", "tiny", "--tokens", "6",
            "--prompt", "8", "--context", "32", "--runs", "1", "--repeats", "1", "--blocks", "4"]
    assert gpu_check.main(tiny + ["--budget-s", "0", "--out", str(tmp_path / "none")]) == 0
    result = json.loads((tmp_path / "none" / "gpu_check.json").read_text())
    assert [s.split(":")[0] for s in result["skipped"]] == ["floors", "costs tiny", "e2e tiny"]
    real = gpu_check.measure_mode

    def fails_for_graphs(check, shape, steps, res):
        if steps == "graphs":
            raise RuntimeError("capture failed")
        return real(check, shape, steps, res)

    monkeypatch.setattr(gpu_check, "measure_mode", fails_for_graphs)
    real_row = gpu_check.oracle_row

    def fails_for_overlap(p, name, *args):
        if "/overlap/" in name:
            raise RuntimeError("Expected all tensors to be on the same device")
        return real_row(p, name, *args)

    monkeypatch.setattr(gpu_check, "oracle_row", fails_for_overlap)
    assert gpu_check.main(tiny + ["--out", str(tmp_path / "one")]) == 0
    result = json.loads((tmp_path / "one" / "gpu_check.json").read_text())
    assert result["errors"][0] == "costs tiny graphs: RuntimeError: capture failed"
    assert result["shapes"]["tiny"]["eager"]["decode_ms"] > 0
    # a row that raises is that row's error: the rows after it in its placement still ran
    failed = [e.split(":")[0] for e in result["errors"][1:]]
    assert failed and all("/overlap/" in e for e in failed)
    assert "tiny/oracle-right2-b4/cpu/cpu/sequential/graphs" in result["e2e"]
    assert all(row["fallback"] is None for k, row in result["e2e"].items() if "/oracle-" in k)


def test_gpu_check_runs_with_only_what_the_gpu_machine_has(tmp_path):
    """As a lent GPU machine runs it: a fresh interpreter with the packages its image lacks hidden
    (benchmarks/gpu_image), so an import of one of them anywhere on the script's path fails here first."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks" / "gpu_image"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--dtype",
                          "float32", "--shapes", "tiny", "--e2e-shapes", "tiny", "--tokens", "6", "--prompt", "8",
                          "--context", "32", "--runs", "1", "--repeats", "1", "--blocks", "4", "--schedules",
                          "sequential", "--modes", "fixed", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["errors"] == [] and result["e2e"]
