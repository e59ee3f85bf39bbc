"""Peers, the decode floor, per-category rows and RESULTS.md generation (tiny models; the real
comparison is benchmarks/field.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_sd.cli import main
from hetero_sd.errors import ConfigError
from hetero_sd.bench.floor import target_bytes
from hetero_sd.bench.peers import peer_names
from hetero_sd.prompts import load_prompts
from hetero_sd.runtime import load

ROOT = Path(__file__).resolve().parents[1]


def test_bench_with_peers_floor_and_categories(tmp_path, tiny_llama, tiny_draft, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t12", "category": "a"}\n{"prompt": "t20 t7", "category": "b"}\n')
    out = tmp_path / "bench.json"
    # the llama.cpp peers cannot run here (no GGUF for a tiny target): asked for by name, they fail the run,
    # with the error in the peers table's headline; the measurements are still kept
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--prompts", str(prompts), "--block-size", "fixed",
                 "--max-new-tokens", "10", "--peers", "transformers,llama.cpp,llama.cpp-dflash,zlab-reference",
                 "--json", str(out)]) == 2
    shown = capsys.readouterr()
    assert "ERROR: 2 peer(s) asked for did not run: llama.cpp:" in " ".join(shown.out.split())
    assert "peer(s) asked for with --peers did not run" in shown.err
    res = json.loads(out.read_text())
    assert [f.split(":")[0] for f in res["peers_failed"]] == ["llama.cpp", "llama.cpp-dflash"]
    rows = {p["name"]: p for p in res["peers"]}
    assert rows["transformers"]["tokens_per_s"] > 0 and rows["transformers"]["ratio_to_spec"] > 0
    assert rows["transformers"]["ratio_to_autoregressive"] > 0 and 0 <= rows["transformers"]["loop_share"] <= 1
    for name in ("llama.cpp", "llama.cpp-dflash"):  # no GGUF for a tiny target, no llama.cpp build in tests
        assert rows[name]["skipped"] and rows[name]["note"]
    zlab = rows["zlab-reference"]
    if not zlab["skipped"]:  # z-lab's package is in `make setup`; without it the row says how to get it
        assert zlab["identical"] and [p["identical"] for p in zlab["prompts"]] == [True, True]
        assert zlab["tau"] >= 1 and all(p["tau_ours"] >= 1 for p in zlab["prompts"])
        assert all("acceptance_differs_at_token" in p for p in zlab["prompts"])
    assert "pip install" in zlab["note"] or not zlab["skipped"]
    assert 0 <= res["loops"]["loop_share"] <= 1 and res["loops"]["tau_loop_free"] >= 1
    assert all(len(r["output_ids"]) == r["spec_tokens"] for r in res["prompts"])
    assert set(res["categories"]) == {"a", "b"}
    floor = res["floor"]
    assert floor["read_bandwidth_gb_s"] > 0 and floor["floor_tokens_per_s"] > 0
    chart, md = tmp_path / "c.png", tmp_path / "RESULTS.md"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results_md.py"), str(out), "--out", str(md),
                    "--chart", str(chart)], check=True)
    text = md.read_text()
    assert "Ahead and behind" in text and "transformers" in text and chart.stat().st_size > 1000
    assert "| loop share | loop-free tau | loop-free speedup |" in text and "| llama.cpp-dflash | - |" in text
    assert zlab["skipped"] or "tokens identical to ours on every prompt" in text


def test_floor_counts_every_weight_once(tiny_llama):
    rt = load(str(tiny_llama), None)
    weights, kv = target_bytes(rt.target)
    cfg = rt.target.config
    per_layer = 4 * (cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
                     + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
                     + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size)
    head = 4 * (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size + cfg.hidden_size)  # lm_head, norm, one embed row
    assert weights == cfg.num_hidden_layers * per_layer + head
    assert kv == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4



def test_floor_counts_the_gguf_blocks_a_step_reads(smollm_random):
    """The default target multiplies its GGUF's Q4_1/Q8_0 blocks: its floor is those bytes (~96 MB), not the
    float32 copies it also keeps (~540 MB), else `bench --floor` puts us far above a physical floor."""
    target = smollm_random.target
    w = target.weights()
    assert w.read_bytes is not None
    weights, _ = target_bytes(target)
    norms = w.norm.nbytes + sum(layer.in_norm.nbytes + layer.post_norm.nbytes for layer in w.layers)
    assert weights == w.read_bytes + norms + w.embed[0].nbytes
    dense = sum(t.nbytes for t in [w.lm_head] + [getattr(layer, a) for layer in w.layers
                                                 for a in ("wqkv", "wo", "w_gate_up", "w_down")])
    assert 4 * weights < dense

def test_peer_names_and_datasets():
    assert peer_names("all") == ["transformers", "transformers-lookup", "llama.cpp", "llama.cpp-dflash", "zlab-reference",
                                 "mlx-lm", "mlx-lm-speculative"]
    with pytest.raises(ConfigError, match="unknown peer"):
        peer_names("vllm")
    both = load_prompts(dataset="math,summarize", limit=2)
    assert [p.category for p in both] == ["math", "math", "summarize", "summarize"]


def test_only_peers_asked_for_by_name_fail_the_run():
    from hetero_sd.bench.peer_row import failures

    rows = [{"name": "transformers", "skipped": False, "note": ""}, {"name": "mlx-lm", "skipped": True,
                                                                      "note": "not installed: pip install mlx-lm"}]
    assert failures(rows, "transformers,mlx-lm") == ["mlx-lm: not installed: pip install mlx-lm"]
    assert failures(rows, "all") == [] and failures(rows, None) == []  # `all`: whatever is installed
    assert failures(rows[:1], "transformers") == []


def test_llama_cpp_dflash_is_compared_with_llama_cpp_autoregressive():
    from hetero_sd.bench.peer_row import PeerRow
    from hetero_sd.bench.peers import compare_llama_cpp

    dflash, plain = PeerRow("llama.cpp-dflash"), PeerRow("llama.cpp")
    for row, answers in ((dflash, [[1, 2, 3], [4, 5, 6]]), (plain, [[1, 2, 3], [4, 9, 6]])):
        for ids in answers:
            row.add(ids, 1.0)
    compare_llama_cpp([dflash, plain])
    assert [p["first_divergence_from_llama.cpp"] for p in dflash.prompts] == [None, 1]
    assert "equal llama.cpp's autoregressive ones on 1 of 2 prompts" in dflash.note


def test_a_bench_stopped_while_its_peers_run_keeps_its_rows_and_the_finished_peers(tmp_path, tiny_llama, tiny_draft,
                                                                                    monkeypatch):
    """Ctrl-C or SIGTERM (a time limit) during the peers: the run's own rows and the peers that finished are in the
    JSON, the rest named as not run, and the status is an interruption's."""
    import hetero_sd.bench.peers as peers

    real = peers.one_peer

    def stopped_at_the_second(name, *args):
        if name == "zlab-reference":
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(peers, "one_peer", stopped_at_the_second)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t12"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--prompts", str(prompts),
                 "--block-size", "fixed", "--max-new-tokens", "6", "--peers", "transformers,zlab-reference",
                 "--json", str(out)]) == 130
    res = json.loads(out.read_text())
    run = res["runs"][0] if "runs" in res else res
    assert res.get("interrupted", True) and run["spec_tokens_per_s"] > 0 and len(run["prompts"]) == 1
    rows = {p["name"]: p for p in run["peers"]}
    assert rows["transformers"]["tokens_per_s"] > 0 and not rows["transformers"]["skipped"]
    assert rows["zlab-reference"]["skipped"] and "stopped" in rows["zlab-reference"]["note"]
