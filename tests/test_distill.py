"""Self-distillation at scale: the prompt mix's reader and filters, the batched generator (its answers are
the runtime's greedy answers), and the resumable shards."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

import hetero_sd
from hetero_sd.errors import ConfigError
from hetero_sd.train.batched import BatchedGenerator
from hetero_sd.train.corpus import Overlap, TrainPrompt, keep, read_records, sharegpt_prompts, function_heads
from hetero_sd.train.distill import ShardStore, generate_shards, load_distilled

from .conftest import make_tiny_target


def conversation(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def truncated_sharegpt() -> str:
    """A ShareGPT-like file cut off inside the third record's string, as the packaged one is."""
    records = [conversation("a_0", ("human", "Write a limerick about a cat"), ("gpt", "..."),
                            ("human", "Now make it rhyme better")),
               conversation("a_1", ("human", "and another one please"), ("gpt", "...")),
               conversation("b_0", ("gpt", "hello"), ("human", "What is a monad?")),
               conversation("c_0", ("human", "This record is cut off"))]
    text = json.dumps(records, indent=2)
    return text[:text.index("cut off")]


def test_sharegpt_reader_recovers_the_records_before_the_cut():
    text = truncated_sharegpt()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert [r["id"] for r in read_records(text)] == ["a_0", "a_1", "b_0"]


def test_sharegpt_openings_and_all_turns():
    text = truncated_sharegpt()
    # openings: the first turn of a conversation's part _0, only when a human wrote it
    assert [(p.key, p.text) for p in sharegpt_prompts(text)] == [("sharegpt:a_0#0", "Write a limerick about a cat")]
    assert [p.key for p in sharegpt_prompts(text, turns="all")] == [
        "sharegpt:a_0#0", "sharegpt:a_0#2", "sharegpt:a_1#0", "sharegpt:b_0#1"]


def test_filters_drop_duplicates_evaluation_overlap_scripts_and_lengths():
    evaluation = ["Write a haiku about the sea.",
                  "Explain in three sentences why the sky is blue and why sunsets are red."]
    prompts = [TrainPrompt("sharegpt:1#0", "Tell me about the history of Rome, briefly."),
               TrainPrompt("sharegpt:2#0", "tell me about   the history of ROME, briefly."),  # duplicate
               TrainPrompt("sharegpt:3#0", "Please write a haiku about the sea, in English."),  # short eval inside
               TrainPrompt("sharegpt:4#0", "Explain in three sentences why the sky is blue and why it rains"),
               TrainPrompt("sharegpt:5#0", "Объясни, почему небо голубое и почему закаты красные."),
               TrainPrompt("sharegpt:6#0", "hi"),
               TrainPrompt("sharegpt:7#0", "Explain why the sky is blue, for a child.")]
    kept, dropped = keep(prompts, Overlap(evaluation))
    assert [p.key for p in kept] == ["sharegpt:1#0", "sharegpt:7#0"]
    assert dropped == {"length": 1, "script": 1, "duplicate": 1, "evaluation": 2}


def test_stdlib_heads_are_documented_public_functions():
    source = 'def f(x):\n    """Return x, a long enough docstring."""\n    return x\n\n' \
             'def _g():\n    """Private, not a training prompt at all."""\n\n' \
             'class C:\n    def m(self):\n        """A method\n        over two lines of text."""\n        pass\n'
    assert list(function_heads(source)) == [
        ("f", 'def f(x):\n    """Return x, a long enough docstring."""'),
        ("m", 'def m(self):\n    """A method\n    over two lines of text."""')]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_batched_answers_are_the_runtimes_greedy_answers(model, request):
    folder = request.getfixturevalue(model)
    rt = hetero_sd.load(str(folder), None)
    rng = random.Random(0)
    prompts = [(str(i), [rng.randrange(4, 64) for _ in range(rng.randrange(3, 20))]) for i in range(25)]
    # 4 slots for 25 prompts: rows leave at EOS and others are prefilled into their slots mid-run
    gen = BatchedGenerator(folder, slots=4, max_new_tokens=30, max_prompt_tokens=24, stop_ids=rt.stop_ids)
    answers = {a.key: a for a in gen.generate(prompts)}
    assert sorted(answers, key=int) == [k for k, _ in prompts]
    stopped = 0
    for key, ids in prompts:
        ref = rt.generate(ids, max_new_tokens=30, stop_at_eos=True).token_ids
        assert answers[key].response_ids == ref, key
        assert answers[key].finished == (ref[-1] in rt.stop_ids)
        stopped += answers[key].finished
    assert 0 < stopped < len(prompts)  # both ways of ending were exercised


def test_a_prompt_over_the_limit_is_an_error(tiny_llama):
    gen = BatchedGenerator(tiny_llama, slots=2, max_new_tokens=4, max_prompt_tokens=8, stop_ids=[1])
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        list(gen.generate([("long", list(range(4, 14)))]))


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory):
    """The tiny target with a chat template (distillation refuses targets without one)."""
    from transformers import AutoTokenizer

    folder = make_tiny_target(tmp_path_factory.mktemp("tiny-chat"), "llama")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = "{% for m in messages %}t5 {{ m['content'] }} t6 {% endfor %}{% if add_generation_prompt %}t7{% endif %}"
    tok.save_pretrained(str(folder))
    return folder


def word_prompts(n: int) -> list[TrainPrompt]:
    rng = random.Random(2)
    return [TrainPrompt(f"test:{i}", " ".join(f"t{rng.randrange(8, 64)}" for _ in range(rng.randrange(2, 9))))
            for i in range(n)]


def test_shards_resume_and_hold_the_runtimes_answers(tmp_path, chat_tiny):
    out, prompts = tmp_path / "shards", word_prompts(9)
    first = generate_shards(chat_tiny, out, max_new_tokens=12, max_prompt_tokens=16, slots=2, prompts=prompts,
                            limit=4, flush_rows=3, progress=out / "progress.json", log=lambda _: None)
    assert first["answered_this_run"] == 4 and first["shards"] == 2  # flushed after 3, then the rest
    again = generate_shards(chat_tiny, out, max_new_tokens=12, max_prompt_tokens=16, slots=2, prompts=prompts,
                            log=lambda _: None)
    assert again["answered_before"] == 4 and again["answered_this_run"] == 5
    assert json.loads((out / "progress.json").read_text())["final"] is True
    rows = load_distilled(out, chat_tiny, texts={p.key: p.text for p in prompts}, log=lambda _: None)
    assert sorted(r["key"] for r in rows) == sorted(p.key for p in prompts)
    rt = hetero_sd.load(str(chat_tiny), None)
    for row in rows:
        text = next(p.text for p in prompts if p.key == row["key"])
        assert row["prompt_ids"] == rt.encode(text)[0]
        assert row["response_ids"] == rt.generate(text, max_new_tokens=12).token_ids
    with np.load(ShardStore.existing(out).shards()[0]) as z:
        assert z["tokens"].dtype == np.uint16  # ids only: no prompt text or prompt ids are stored
        assert sorted(z.files) == ["finished", "keys", "offsets", "prompt_crc", "prompt_len", "tokens"]


def test_a_new_store_answers_only_prompts_no_other_store_has(tmp_path, chat_tiny):
    """--skip-answered: the prompts another store answered are left out of a new store's job."""
    from hetero_sd.train.distill import unanswered
    prompts = word_prompts(7)
    generate_shards(chat_tiny, tmp_path / "a", max_new_tokens=4, max_prompt_tokens=16, slots=2, prompts=prompts[:3],
                    log=lambda _: None)
    todo = unanswered(prompts, [tmp_path / "a"])
    assert [p.key for p in todo] == [p.key for p in prompts[3:]]
    generate_shards(chat_tiny, tmp_path / "b", max_new_tokens=4, max_prompt_tokens=16, slots=2, prompts=todo,
                    log=lambda _: None)
    assert unanswered(prompts, [tmp_path / "a", tmp_path / "b"]) == []


def test_changed_prompts_and_settings_are_refused(tmp_path, chat_tiny):
    out, prompts = tmp_path / "shards", word_prompts(3)
    generate_shards(chat_tiny, out, max_new_tokens=6, max_prompt_tokens=16, slots=2, prompts=prompts,
                    log=lambda _: None)
    with pytest.raises(ConfigError, match="made differently"):
        generate_shards(chat_tiny, out, max_new_tokens=7, max_prompt_tokens=16, slots=2, prompts=prompts)
    changed = {p.key: p.text + " t9" for p in prompts[:1]} | {p.key: p.text for p in prompts[1:]}
    notes = []
    rows = load_distilled(out, chat_tiny, texts=changed, log=notes.append)
    assert len(rows) == 2 and "1 whose prompt reads differently" in notes[0]


def test_a_target_without_chat_template_is_refused(tmp_path, tiny_llama):
    folder = tmp_path / "plain"
    shutil.copytree(tiny_llama, folder)
    with pytest.raises(ConfigError, match="chat template"):
        generate_shards(folder, tmp_path / "s", max_new_tokens=4, max_prompt_tokens=8, slots=2,
                        prompts=word_prompts(2), log=lambda _: None)


def test_cli_asks_for_what_it_needs(capsys):
    from hetero_sd.cli import main

    assert main(["train-draft", "--generate-only"]) == 2
    assert "--distill DIR" in capsys.readouterr().err
    assert main(["train-draft", "--distill", "somewhere"]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.slow
def test_int8_answers_name_their_k_cache_and_are_never_mixed(tmp_path, default_folder, monkeypatch):
    """The int8 generator's K cache follows the runtime's (q8_0 blocks where the CPU has AVX512-VNNI, else float16;
    HETERO_SD_KV=float16 passes k_q8=False): the manifest names a q8_0 K, so a store made with the other cache is
    refused, not extended, and before the target's weights load."""
    from hetero_sd.backends.torch_backend.cpu import cpu_flags
    from hetero_sd.backends.torch_backend.plan import Q8_K_FLAGS

    out, prompts = tmp_path / "int8", word_prompts(2)
    generate_shards(default_folder, out, max_new_tokens=4, max_prompt_tokens=32, slots=2, prompts=prompts,
                    dtype="int8", k_q8=False, log=lambda _: None)
    assert json.loads((out / "manifest.json").read_text())["decoding"] == "greedy, int8"
    if not Q8_K_FLAGS <= cpu_flags():
        pytest.skip("no q8_0 K cache on this CPU (it needs AVX512-VNNI)")
    from hetero_sd.train import batched

    def no_target(*a, **k):
        raise AssertionError("the target loaded before the store was checked")
    with monkeypatch.context() as m, pytest.raises(ConfigError, match="HETERO_SD_KV=float16"):
        m.setattr(batched, "build_target", no_target)
        generate_shards(default_folder, out, max_new_tokens=4, max_prompt_tokens=32, slots=2, prompts=prompts,
                        dtype="int8", log=lambda _: None)
    generate_shards(default_folder, tmp_path / "q8", max_new_tokens=4, max_prompt_tokens=32, slots=2, prompts=prompts,
                    dtype="int8", log=lambda _: None)
    assert json.loads((tmp_path / "q8" / "manifest.json").read_text())["decoding"] == "greedy, int8, q8_0 K"
