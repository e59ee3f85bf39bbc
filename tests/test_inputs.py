"""Input checks: every value a user can type is refused with one line naming it and the fix
(exit status 2) before any model loads, or has a documented meaning. Tables keep the cases compact;
almost all fail before any model work, so they are fast."""

from __future__ import annotations

import json
import os

import pytest

import hetero_sd
from hetero_sd.cli import main
from hetero_sd.errors import ConfigError, HeteroSDError, InvalidArgumentError

CORES = os.cpu_count() or 1
BIG = str(2**64)


def refused(argv: list[str], capsys, expected: str) -> None:
    assert main(argv) == 2
    out = capsys.readouterr().err
    lines = [x for x in out.splitlines() if x.strip()]
    assert lines[0].startswith("error:") and expected in out and "fix:" in out and "Traceback" not in out, out


GENERATE = [
    (["--seed", BIG, "--temperature", "1"], "seed must be < 2^64"),
    (["--temperature", "1e-300"], "below 0.0001"),
    (["--temperature", "1e-39"], "below 0.0001"),
    (["--threads", str(2**31)], "more than this machine's"),
    (["--threads", str(CORES + 1)], "more than this machine's"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--draft-device", ""], "--draft-device is empty"),
    (["--schedule", "pipeline"], "needs two requests"),
]


@pytest.mark.parametrize("extra,expected", GENERATE, ids=[" ".join(a) for a, _ in GENERATE])
def test_generate_refuses(extra, expected, capsys):
    refused(["generate", "Hi", "--target", "/nonexistent", *extra], capsys, expected)


BENCH = [
    (["--blocks", "abc"], "--blocks 'abc' is neither"),
    (["--blocks", "4,,8"], "--blocks '4,,8' has an empty item"),
    (["--blocks", "1"], "leaves no room"),
    (["--schedule", ","], "--schedule ',' has an empty item"),
    (["--schedule", "fast"], "unknown schedule 'fast'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", ","], "--temperature names no temperature"),
    (["--placements", ","], "--placements ',' has an empty item"),
    (["--dataset", ""], "--dataset '' has an empty item"),
    (["--peers", "bogus"], "unknown peer(s) bogus"),
    (["--peers", "transformers,"], "has an empty item"),
    (["--draft-device", ""], "--draft-device is empty"),
    (["--seed", BIG], "seed must be < 2^64"),
]


@pytest.mark.parametrize("extra,expected", BENCH, ids=[" ".join(a) for a, _ in BENCH])
def test_bench_refuses_before_the_run(extra, expected, capsys):
    refused(["bench", "--target", "/nonexistent", *extra], capsys, expected)


def test_bench_prompts_file_cases(tmp_path, capsys):
    cases = [('{"prompt": ""}', "the prompt is empty"), ('{"turns": [{"a": 1}]}', "the first turn is not text"),
             ('{"turns": [5]}', "the first turn is not text")]
    for line, expected in cases:
        f = tmp_path / "p.jsonl"
        f.write_text(line + "\n")
        refused(["bench", "--target", "/nonexistent", "--prompts", str(f)], capsys, expected)
    from hetero_sd.prompts import load_prompts

    f.write_text('{"turns": [{"role": "user", "content": "Hello"}, "later"]}\n')
    assert [p.text for p in load_prompts(f)] == ["Hello"]  # a message's content is its text


@pytest.mark.parametrize("window", ["-5", "0", "100000"])
def test_compile_ane_window(window, tmp_path, capsys):
    refused(["compile-ane", "--draft", "random", "--out", str(tmp_path / "d.mlpackage"), "--window", window],
            capsys, "--window must be from 1 to")


def test_compile_ane_window_not_a_number(tmp_path):
    with pytest.raises(SystemExit) as e:  # argparse: one usage line and status 2
        main(["compile-ane", "--draft", "random", "--out", str(tmp_path / "d.mlpackage"), "--window", "1e9"])
    assert e.value.code == 2


def test_compile_ane_read_only_out_is_refused_before_work(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        refused(["compile-ane", "--draft", "random", "--out", str(ro / "d.mlpackage")], capsys, "cannot be written")
    finally:
        ro.chmod(0o700)


TRAIN = [
    (["--block-size", "0"], "--block-size must be >= 2"), (["--block-size", "1"], "--block-size must be >= 2"),
    (["--layers", "0"], "--layers must be >= 1"), (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--lr", "-1"], "--lr must be a finite number > 0"), (["--threads", "-1"], "--threads must be >= 1"),
    (["--eval-every", "0"], "--eval-every must be >= 1"), (["--pack", "0"], "--pack must be >= 1"),
    (["--anchors", "-1"], "--anchors must be >= 0"), (["--max-new-tokens", "-2"], "--max-new-tokens must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"), (["--steps", "-1"], "--steps must be >= 1"),
    (["--prompts", "-3"], "--prompts must be >= 1"), (["--accumulate", "0"], "--accumulate must be >= 1"),
    (["--data", "/nonexistent.jsonl"], "is not a file"), (["--minutes", "0"], "--minutes must be a finite number > 0"),
    (["--minutes", "inf"], "--minutes must be a finite number > 0"),
    (["--attention-group", "-1"], "--attention-group must be >= 0"), (["--ce-chunk", "-5"], "--ce-chunk must be >= 0"),
]


@pytest.mark.parametrize("extra,expected", TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_train_draft_refuses(extra, expected, tmp_path, capsys):
    refused(["train-draft", "--target", "/nonexistent", "--out", str(tmp_path / "out"), *extra], capsys, expected)


def test_train_draft_data_and_out(tmp_path, capsys, tiny_llama):
    out = str(tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    for text, expected in [("not json\n", "is not JSON"), ('{"prompt_ids": [1], "response_ids": "x"}\n',
                                                            "'response_ids' is not a list of token ids")]:
        bad.write_text(text)
        refused(["train-draft", "--target", "/nonexistent", "--out", out, "--data", str(bad)], capsys, expected)
    bad.write_text('{"prompt_ids": [1, 2], "response_ids": [3, 999]}\n')
    refused(["train-draft", "--target", str(tiny_llama), "--out", out, "--data", str(bad)], capsys,
            "token id 999 is outside the target's vocabulary [0, 64)")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    refused(["train-draft", "--target", "/nonexistent", "--out", str(a_file)], capsys, "is a file, not a folder")


# --- the Python API -----------------------------------------------------------------------------------------
LOAD = [
    (dict(target=123), "target must be a non-empty string"),
    (dict(target="default", draft=5), "draft must be a non-empty string"),
    (dict(target_device=None), "target_device must be a non-empty string"),
    (dict(draft_device=""), "draft_device must be a non-empty string"),
    (dict(schedule=3), "schedule must be a non-empty string"),
    (dict(max_context=0), "max_context must be >= 1"),
    (dict(max_context=-1), "max_context must be >= 1"),
    (dict(max_context="8"), "max_context must be an integer"),
    (dict(cpu_threads=10**6), "more than this machine's"),
]


@pytest.mark.parametrize("kwargs,expected", LOAD, ids=[str(k) for k, _ in LOAD])
def test_load_refuses_arguments_of_the_wrong_type_or_range(kwargs, expected):
    args = dict(target="/nonexistent") | kwargs
    with pytest.raises(InvalidArgumentError) as e:
        hetero_sd.load(**args)
    assert expected in e.value.problem


@pytest.fixture(scope="module")
def rt(tiny_llama, tiny_draft):
    return hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed")


@pytest.mark.parametrize("call,expected", [
    (lambda rt: rt.generate(""), "the prompt is empty"),
    (lambda rt: rt.generate("t5", schedule="pipeline"), "needs two requests"),
    (lambda rt: rt.generate_many("abc"), "prompts must be a list of prompts"),
    (lambda rt: rt.generate("t5", temperature=1e-300), "below 0.0001"),
    (lambda rt: rt.generate("t5", temperature=1.0, seed=2**64), "seed must be < 2^64"),
], ids=["empty", "pipeline", "generate_many-str", "tiny-temperature", "seed-2^64"])
def test_api_refuses(rt, call, expected):
    with pytest.raises(HeteroSDError) as e:
        call(rt)
    assert expected in e.value.problem


def test_tiny_top_p_keeps_the_likeliest_token(rt):
    """top_p 1e-46 rounds to 0 in float32: it means greedy sampling, not NaN probabilities."""
    greedy = rt.generate("t5 t9", max_new_tokens=8, speculative=False)
    for top_p in (1e-46, 1e-45):
        out = rt.generate("t5 t9", max_new_tokens=8, temperature=1.0, top_p=top_p, seed=1, speculative=False)
        assert out.token_ids == greedy.token_ids


def test_seed_just_below_2_64_works(rt):
    a = rt.generate("t5 t9", max_new_tokens=6, temperature=1.0, seed=2**64 - 1)
    assert len(a.token_ids) == 6


# --- the cost cache -----------------------------------------------------------------------------------------
BAD_COSTS = ["[]", "null", '{"costs": {}}', "{not json", "KEYED:{\"verify_s\": {}}", "KEYED:{\"decode_s\": 0}",
             "KEYED:{\"decode_s\": -1}", "KEYED:{\"decode_s\": NaN}", "KEYED:{\"decode_s\": 0.01, \"verify_s\": {\"2\": -3}}"]


@pytest.mark.parametrize("content", BAD_COSTS)
def test_a_cost_file_of_the_wrong_shape_is_ignored_announced_and_measured_again(content, rt, tmp_path, monkeypatch):
    from hetero_sd.decoding import cost_cache
    from hetero_sd.decoding.costs import Costs

    monkeypatch.setenv("HETERO_SD_HOME", str(tmp_path))
    monkeypatch.setattr(cost_cache, "machine_busy", lambda: None)
    good = Costs(decode_s=0.01, verify_s={2: 0.012, 6: 0.015}, draft_s={2: 0.002, 6: 0.003})
    measured = []
    monkeypatch.setattr(cost_cache, "measure_costs", lambda *a, **k: measured.append(1) or good)
    key = cost_cache.cost_key("t", "d", "cpu", "cpu", "float32", 6)
    path = cost_cache.cost_path(key)
    path.parent.mkdir(parents=True)
    if content.startswith("KEYED:"):
        full = {"decode_s": 0.01, "verify_s": {"2": 0.01}, "draft_s": {"2": 0.01}} | json.loads(content[6:])
        path.write_text(json.dumps({"key": key, "costs": full}))  # json writes float("nan") as NaN
    else:
        path.write_text(content)
    notes = []
    costs = cost_cache.costs_for(rt.target, rt.draft, key, notes)
    assert measured == [1] and costs.decode_s == 0.01
    assert any(str(path) in n and "ignored" in n for n in notes), notes
    assert cost_cache.cached_costs(key) is not None  # replaced by the new measurement


def test_costs_measured_on_a_busy_machine_are_measured_again_when_quiet(rt, tmp_path, monkeypatch):
    from hetero_sd.decoding import cost_cache
    from hetero_sd.decoding.costs import Costs

    monkeypatch.setenv("HETERO_SD_HOME", str(tmp_path))
    measured = []
    slow = Costs(decode_s=0.3, verify_s={2: 0.4}, draft_s={2: 0.1})
    monkeypatch.setattr(cost_cache, "measure_costs", lambda *a, **k: measured.append(1) or slow)
    key = cost_cache.cost_key("t", "d", "cpu", "cpu", "float32", 6)
    monkeypatch.setattr(cost_cache, "machine_busy", lambda: "load average 9.0 on 2 cores")
    notes = []
    cost_cache.costs_for(rt.target, rt.draft, key, notes)
    assert any("busy" in n for n in notes)
    cost_cache.costs_for(rt.target, rt.draft, key, [])
    assert len(measured) == 1  # still busy: the cached costs are as good as any measured now
    monkeypatch.setattr(cost_cache, "machine_busy", lambda: None)
    notes = []
    cost_cache.costs_for(rt.target, rt.draft, key, notes)
    assert len(measured) == 2 and any("measuring them again" in n for n in notes)
    cost_cache.costs_for(rt.target, rt.draft, key, [])
    assert len(measured) == 2  # measured quiet: kept


# --- a corrupted converted model ------------------------------------------------------------------------------
def test_a_damaged_converted_folder_is_detected(tmp_path, tiny_llama):
    import shutil

    from hetero_sd.loading.default_model import converted_problem

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    (folder / "tokenizer.json").exists() or pytest.skip("the tiny tokenizer has no tokenizer.json")
    assert converted_problem(folder) is None
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "model.safetensors has" in converted_problem(folder)
    (folder / "config.json").write_text("{")
    assert "JSONDecodeError" in converted_problem(folder)


def test_fetch_default_reconverts_a_damaged_copy(tmp_path, monkeypatch, tiny_llama):
    """The damaged default folder is announced and converted again (the conversion is stubbed: it copies
    a tiny model and writes the marker)."""
    import shutil

    from hetero_sd.loading import default_model as dm

    monkeypatch.setenv("HETERO_SD_HOME", str(tmp_path))
    folder = tmp_path / "models" / dm.DEFAULT_TARGET
    shutil.copytree(tiny_llama, folder)
    (folder / dm._DONE).write_text("x.gguf")
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    converted = []

    def convert(gguf, out):
        converted.append(out)
        shutil.copytree(tiny_llama, out)
        (out / dm._DONE).write_text(str(gguf))
    monkeypatch.setattr(dm, "convert_gguf", convert)
    monkeypatch.setattr(dm, "check_gguf", lambda g: None)
    assert main(["fetch", "default"]) == 0
    assert converted == [folder] and dm.converted_problem(folder) is None


# --- bad values inside a target's config.json -------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("hidden_size", "576"), ("num_hidden_layers", None), ("num_hidden_layers", -3),
                                       ("num_attention_heads", 0), ("rms_norm_eps", "abc"), ("vocab_size", 1.5)])
def test_a_config_value_of_the_wrong_type_is_named(tmp_path, tiny_llama, key, value):
    import shutil

    folder = tmp_path / "t"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        hetero_sd.load(str(folder), None)
    assert key in e.value.problem and repr(value) in e.value.problem
