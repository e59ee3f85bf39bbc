"""One Runtime shared safely, nothing lost, every bad input refused up front.

Sections: concurrency (threads and interleaved streams against sequential T=0 outputs), the API's
checks, the CLI's (subprocess: exit 2, one `error:` line and a `fix:` line, no traceback), lost work
(bench/generate files, SIGTERM), the model home (lock, stale temp folders, unusable homes)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import hetero_sd
from hetero_sd.errors import InvalidArgumentError, RuntimeClosedError

THREADS, PER_THREAD, NEW = 8, 4, 12


def id_prompts(n: int) -> list[list[int]]:
    """Distinct raw-id prompts of different lengths, so that outputs differ and cross-talk shows."""
    return [[4 + (7 * i) % 50, 10 + (3 * i) % 40, 5 + i % 30][: 2 + i % 2] + [6 + (11 * i) % 45] for i in range(n)]


@pytest.fixture(scope="module")
def shared(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft))
    yield rt
    rt.close()


def concurrently(fn, jobs: list, threads: int = THREADS) -> list:
    """Run fn over jobs from `threads` threads that start together, each taking consecutive jobs."""
    start = threading.Barrier(threads)
    chunks = [jobs[i::threads] for i in range(threads)]

    def worker(chunk):
        start.wait()
        return [fn(j) for j in chunk]

    with ThreadPoolExecutor(threads) as pool:
        per_thread = list(pool.map(worker, chunks))
    out = [None] * len(jobs)
    for i, results in enumerate(per_thread):
        out[i::threads] = results
    return out


@pytest.mark.parametrize("speculative,schedule", [(True, "sequential"), (True, "overlap"), (False, "sequential")])
def test_threads_sharing_one_runtime_get_the_sequential_outputs(shared, speculative, schedule):
    prompts = id_prompts(THREADS * PER_THREAD)
    kw = dict(max_new_tokens=NEW, temperature=0.0, speculative=speculative, schedule=schedule)
    alone = [shared.generate(p, **kw).token_ids for p in prompts]
    assert len({tuple(a) for a in alone}) > len(prompts) // 2  # outputs differ: cross-talk would show
    together = concurrently(lambda p: shared.generate(p, **kw).token_ids, prompts)
    assert together == alone


def test_interleaved_streams_in_one_thread(shared):
    prompts = id_prompts(3)
    alone = [shared.generate(p, max_new_tokens=NEW).token_ids for p in prompts]
    streams = [iter(shared.stream(p, max_new_tokens=NEW)) for p in prompts]
    got = [[] for _ in prompts]
    live = set(range(len(prompts)))
    while live:  # one step of each in turn: every stream is mid-generation while the others advance
        for i in sorted(live):
            event = next(streams[i], None)
            if event is None:
                live.discard(i)
            else:
                got[i] += event.token_ids
    assert got == alone


def test_an_abandoned_stream_gives_its_caches_back(shared):
    before = len(shared.slots.free)
    stream = shared.stream(id_prompts(1)[0], max_new_tokens=NEW)
    next(stream)
    assert len(shared.slots.free) == before - 1 or before == 1 and len(shared.slots.free) == 0
    stream.close()
    assert len(shared.slots.free) == before


def test_generate_many_concurrently_with_generate(shared):
    prompts = id_prompts(6)
    alone = [shared.generate(p, max_new_tokens=NEW).token_ids for p in prompts]
    jobs = ["many", *range(len(prompts))]

    def run(job):
        if job == "many":
            return [g.token_ids for g in shared.generate_many(prompts, schedule="pipeline", max_new_tokens=NEW)]
        return shared.generate(prompts[job], max_new_tokens=NEW).token_ids

    out = concurrently(run, jobs, threads=len(jobs))
    assert out[0] == alone and out[1:] == alone


def test_default_model_two_threads_at_once(smollm_random):
    """On the real model: two generations at once, with and without the draft."""
    prompts = ["Tell me about mathematics.", "Name a colour."]
    for speculative in (True, False):
        kw = dict(max_new_tokens=8, speculative=speculative)
        alone = [smollm_random.generate(p, **kw).text for p in prompts]
        assert concurrently(lambda p: smollm_random.generate(p, **kw).text, prompts, threads=2) == alone


def test_a_loaded_runtime_is_out_of_the_collectors_walk_until_closed(tiny_llama):
    """A full collection would walk every object of the loaded models (holding the GIL: the decoding thread
    stalls); load() freezes them, close() gives them back so a closed runtime's cycles can be freed."""
    import gc

    gc.unfreeze()
    rt = hetero_sd.load(str(tiny_llama), None)
    assert gc.get_freeze_count() > 0
    assert not any(o is rt.target for o in gc.get_objects())  # frozen: in no generation the collector walks
    rt.close()
    assert gc.get_freeze_count() == 0


def test_closed_runtime_says_so(tiny_llama):
    rt = hetero_sd.load(str(tiny_llama), None)
    rt.close()
    for call in (lambda: rt.generate("t5 t6"), lambda: rt.stream("t5 t6"), lambda: rt.generate_many(["t5"])):
        with pytest.raises(RuntimeClosedError, match="this Runtime was closed"):
            call()


# --- the API refuses bad input up front, with a hetero_sd.errors type ---------------------------------

BAD_CALLS = [
    (b"Hi", {}, "the prompt is bytes"),
    (None, {}, "must be a str, a list of token ids or a list of messages, got NoneType"),
    (123, {}, "got int"),
    ([], {}, "the prompt is an empty list"),
    ([-1, 5], {}, r"token ids \[-1\] are outside the target's vocabulary \[0, 64\)"),
    ([10 ** 6], {}, r"token ids \[1000000\] are outside"),
    ([5, "t6"], {}, "mixes types"),
    ([{"role": "user"}], {}, "message 0 needs a str 'role' and a str 'content'"),
    ("t5 \udcff", {}, "not valid UTF-8"),
    ("t5", {"max_new_tokens": "10"}, "max_new_tokens must be an integer, got '10'"),
    ("t5", {"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
    ("t5", {"max_new_tokens": -5}, "max_new_tokens must be >= 0"),
    ("t5", {"temperature": -1}, "temperature must be >= 0"),
    ("t5", {"temperature": float("nan")}, "temperature must be finite"),
    ("t5", {"temperature": True}, "temperature must be a number"),
    ("t5", {"temperature": 0.7, "top_p": 0}, r"top_p must be in \(0, 1\]"),
    ("t5", {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ("t5", {"top_k": -3}, "top_k must be >= 0"),
    ("t5", {"seed": 1.5}, "seed must be an integer"),
    ("t5", {"rule": "greedy"}, "unknown acceptance rule"),
    ("t5", {"block": 999}, r"block 999 is outside what this draft fills \(2 to its own block size, 6\)"),
    ("t5", {"block": 1}, r"block 1 is outside what this draft fills"),
    ("t5", {"speculative": "no"}, "speculative must be True or False"),
]


@pytest.mark.parametrize("prompt,kwargs,message", BAD_CALLS)
def test_bad_api_input_is_refused_before_any_model_work(shared, prompt, kwargs, message):
    calls = []
    real = shared.slots.take
    shared.slots.take = lambda: calls.append(1) or real()
    try:
        for call in (shared.generate, shared.stream):  # stream refuses at the call, not at the first step
            with pytest.raises(InvalidArgumentError, match=message) as caught:
                call(prompt, chat=False, **kwargs)
            assert "(fix: " in str(caught.value) and caught.value.fix
    finally:
        del shared.slots.take
    assert calls == []  # no caches were taken: nothing ran


def test_generate_many_checks_every_prompt_first(shared):
    with pytest.raises(InvalidArgumentError, match="outside the target's vocabulary"):
        shared.generate_many([[5, 6], [999]], max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        shared.generate_many([[5, 6], [7]], temperature=-1)


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": 999}, r"block size 999 is outside what this draft fills \(2 to its own block size, 6\)"),
    ({"block_size": 1}, "block size 1 is outside"),
    ({"block_size": "8"}, "block size must be an integer, 'auto' or 'fixed'"),
    ({"cpu_threads": -1}, "threads must be >= 1"),
    ({"cpu_threads": 0}, "threads must be >= 1"),
])
def test_load_refuses_bad_settings(tiny_llama, tiny_draft, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        hetero_sd.load(str(tiny_llama), str(tiny_draft), **kwargs)


def test_a_target_without_a_tokenizer_is_named(tmp_path, tiny_llama):
    import shutil

    from hetero_sd.errors import ModelNotFoundError

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, bare / name)
    with pytest.raises(ModelNotFoundError, match="has no tokenizer"):
        hetero_sd.load(str(bare), None)


# --- the CLI: exit 2, one `error:` line and one `fix:` line, no traceback ------------------------------

def refused(capsys, argv: list[str], message: str) -> None:
    from hetero_sd.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert lines[-2].startswith("error: ") and lines[-1].startswith("fix: "), err
    assert message in lines[-2], err
    assert "Traceback" not in err


def prompts_file(folder, text: str | bytes, name: str = "p.jsonl"):
    path = folder / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("argv,message", [
    (["--temperature", "-1"], "--temperature must be >= 0, got -1"),
    (["--temperature", "nan"], "--temperature must be finite"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-k", "-3"], "--top-k must be >= 0, got -3"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 0, got -5"),
    (["--threads", "-1"], "--threads must be >= 1, got -1"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--block-size", "1"], "--block-size 1 leaves no room for drafts"),
    (["--schedule", "fast"], "unknown schedule 'fast'"),
    (["--schedule", "pipeline"], "the pipeline schedule needs two requests at once"),
    (["--json", "/nonexistent/dir/out.json"], "the folder /nonexistent/dir does not exist"),
    (["--trace", "/nonexistent/dir/t.json"], "the folder /nonexistent/dir does not exist"),
])
def test_generate_refuses_bad_flags_before_loading(capsys, argv, message):
    # --target names no model: the flags are refused before anything is loaded
    refused(capsys, ["generate", "hi", "--target", "/no/such/model", *argv], message)


def test_generate_refuses_an_empty_prompt_and_a_json_directory(capsys, tmp_path):
    refused(capsys, ["generate", "", "--no-chat", "--target", "/no/such/model"], "the prompt is empty")
    refused(capsys, ["generate", "hi", "--json", str(tmp_path)], f"--json {tmp_path} is a directory")


def test_generate_refuses_a_prompt_that_encodes_to_nothing(capsys, tiny_llama):
    refused(capsys, ["generate", " ", "--no-chat", "--target", str(tiny_llama)], "the prompt is empty")


def test_generate_refuses_a_block_larger_than_the_draft(capsys, tiny_llama, tiny_draft):
    refused(capsys, ["generate", "t5", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--block-size", "999"],
            "block size 999 is outside what this draft fills (2 to its own block size, 6)")


def test_chat_refuses_bad_flags_before_starting(capsys, tmp_path):
    refused(capsys, ["chat", "--temperature", "-1"], "--temperature must be >= 0")
    refused(capsys, ["chat", "--save-dir", str(tmp_path / "absent")], "is not a folder")


@pytest.mark.parametrize("argv,message", [
    (["--limit", "0"], "--limit must be >= 1, got 0"),
    (["--limit", "-1"], "--limit must be >= 1, got -1"),
    (["--temperature", "0,-1"], "--temperature must be >= 0, got -1"),
    (["--schedule", "sequential,sideways"], "unknown schedule 'sideways'"),
    (["--json", "/nonexistent/dir/out.json"], "the folder /nonexistent/dir does not exist"),
])
def test_bench_refuses_bad_flags_before_loading(capsys, argv, message):
    refused(capsys, ["bench", "--target", "/no/such/model", *argv], message)


@pytest.mark.parametrize("content,message", [
    ("[1, 2]\n", "p.jsonl:1 is a JSON list, not an object"),
    ('"just a string"\n', "p.jsonl:1 is a JSON str, not an object"),
    (b'\xff\xfe{"prompt": "x"}\n', "is not UTF-8"),
    ('{"prompt": "\\ud800"}\n', "p.jsonl:1 is not valid UTF-8"),
])
def test_bench_refuses_bad_prompts_files(capsys, tmp_path, content, message):
    refused(capsys, ["bench", "--target", "/no/such/model", "--prompts", str(prompts_file(tmp_path, content))], message)


def test_bench_refuses_a_directory_as_prompts_file(capsys, tmp_path):
    refused(capsys, ["bench", "--prompts", str(tmp_path)], f"prompts file {tmp_path} is a directory")


def test_bench_refuses_blocks_the_draft_cannot_fill_before_the_first_prompt(capsys, tmp_path, tiny_llama, tiny_draft):
    refused(capsys, ["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--blocks", "4,999",
                     "--prompts", str(prompts_file(tmp_path, '{"prompt": "t5"}\n'))],
            "block 999 is outside what this draft fills (2 to its own block size, 6)")
    refused(capsys, ["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--block-size", "999",
                     "--prompts", str(prompts_file(tmp_path, '{"prompt": "t5"}\n'))], "block size 999 is outside")


def test_an_invalid_utf8_prompt_in_argv(tmp_path):
    """A command line of invalid UTF-8 bytes (Python decodes it with surrogate escapes)."""
    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "generate", b"\xff\xfehi", "--target", "/no/model"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error: the prompt is not valid UTF-8" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_file_that_is_not_gguf(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SD_HOME", str(tmp_path / "home"))
    fake = prompts_file(tmp_path, "<html>not found</html>", "model.gguf")
    refused(capsys, ["generate", "hi", "--target", str(fake)], "is not a GGUF file")
    assert not list((tmp_path / "home").rglob("*.tmp-*"))  # no temp folder left behind


@pytest.mark.parametrize("make_home,message", [
    (lambda tmp: tmp.joinpath("file").write_text("x") and tmp / "file", "is a file, not a folder"),
    (lambda tmp: tmp.joinpath("file").write_text("x") and tmp / "file" / "home", "cannot be created"),
])
def test_an_unusable_home(capsys, tmp_path, monkeypatch, make_home, message):
    monkeypatch.setenv("HETERO_SD_HOME", str(make_home(tmp_path)))
    refused(capsys, ["generate", "hi"], message)


def test_a_read_only_home_is_named_when_a_conversion_needs_it(capsys, tmp_path, monkeypatch):
    """A read-only file system (os.access says so even for root); a converted model would still load."""
    import hetero_sd.home

    monkeypatch.setenv("HETERO_SD_HOME", str(tmp_path))
    monkeypatch.setattr(hetero_sd.home.os, "access", lambda path, mode: not mode & os.W_OK)
    refused(capsys, ["generate", "hi"], f"hetero-sd's home {tmp_path} is read-only")


def test_fetch_offline_does_not_say_to_run_fetch(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "fetch", "acme/absent"],
                         env=dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unset HF_HUB_OFFLINE" in out.stderr and "hetero-sd fetch" not in out.stderr


# --- nothing lost -------------------------------------------------------------------------------------

def many_prompts(folder, n: int):
    return prompts_file(folder, "".join(f'{{"prompt": "t{5 + i % 50} t{9 + i % 40}"}}\n' for i in range(n)))


def test_bench_writes_each_prompt_as_it_finishes(tmp_path, tiny_llama, tiny_draft, monkeypatch):
    import json

    import hetero_sd.bench.runner as bench
    from hetero_sd.cli import main

    out, seen = tmp_path / "b.json", []
    real = bench.run_bench

    def watching(*args, progress=None, **kw):
        def tick(row):
            progress(row)
            seen.append(len(json.loads(out.read_text())["in_progress"]["prompts"]))
        return real(*args, progress=tick, **kw)

    monkeypatch.setattr(bench, "run_bench", watching)
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--max-new-tokens", "4",
                 "--prompts", str(many_prompts(tmp_path, 3)), "--json", str(out)])
    assert code == 0 and seen == [1, 2, 3]
    doc = json.loads(out.read_text())
    assert len(doc["prompts"]) == 3 and "in_progress" not in doc and doc["lossless"] is True
    assert not list(tmp_path.glob(".b.json.tmp-*"))  # atomic replace left no temp file


def test_bench_keeps_finished_prompts_on_sigterm(tmp_path, tiny_llama, tiny_draft):
    """What `timeout` and CI send: the finished prompts are in the JSON and the exit status is 143."""
    import json
    import signal
    import time

    out, n = tmp_path / "b.json", 200
    proc = subprocess.Popen([sys.executable, "-m", "hetero_sd.cli", "bench", "--target", str(tiny_llama), "--draft",
                             str(tiny_draft), "--max-new-tokens", "48", "--prompts", str(many_prompts(tmp_path, n)),
                             "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    began = time.monotonic()
    while not out.exists() and proc.poll() is None and time.monotonic() - began < 120:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and 1 <= len(doc["prompts"]) < n
    assert "Traceback" not in stderr and "hetero-sd bench" in stdout  # the table of what finished


def test_generate_json_keeps_the_text_on_interrupt(tmp_path, tiny_llama, tiny_draft, monkeypatch, capsys):
    import json

    from hetero_sd.cli import main
    from hetero_sd.runtime import Runtime

    real = Runtime.stream

    def interrupted_after_three_steps(self, *args, **kw):
        for n, event in enumerate(real(self, *args, **kw)):
            if n == 3:
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(Runtime, "stream", interrupted_after_three_steps)
    out = tmp_path / "g.json"
    code = main(["generate", "t5 t6", "--no-chat", "--target", str(tiny_llama), "--draft", str(tiny_draft),
                 "--max-new-tokens", "40", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert code == 130 and doc["interrupted"] is True and len(doc["token_ids"]) >= 3
    assert doc["text"] and doc["text"] in capsys.readouterr().out


def test_chat_save_errors_are_shown_and_the_conversation_stays(tmp_path, tiny_llama):
    import asyncio

    from hetero_sd.tui import ChatApp

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the transcript folder should be")
    app = ChatApp({"target": str(tiny_llama), "draft": None}, max_new_tokens=4, save_dir=blocked)

    async def scenario():
        async with app.run_test(size=(100, 30)) as pilot:
            while app.query_one("#prompt").disabled:
                await pilot.pause(0.1)
            await pilot.click("#prompt")
            await pilot.press(*"t5 t9", "enter")
            while app.generating or len(app.conversation.messages) < 2:
                await pilot.pause(0.1)
            await pilot.press("ctrl+s")
            await pilot.pause(0.2)
            error = str(app.query(".error").last().render())
            assert f"cannot save the conversation in {blocked}" in error and "fix:" in error
            assert len(app.conversation.messages) == 2 and app.is_running  # nothing lost, still running
            app.save_dir = tmp_path  # the user fixes it and saves again
            await pilot.press("ctrl+s")
            await pilot.pause(0.2)
            note = str(app.query(".note").last().render())
            assert note.startswith(f"saved {tmp_path}/hetero-sd-chat-")  # the full path
            saved = next(tmp_path.glob("hetero-sd-chat-*.md")).read_text()
            assert "t5 t9" in saved

    asyncio.run(scenario())


# --- the model home: one conversion however many processes start ---------------------------------------

CONVERT = """
import sys, time
from pathlib import Path
import hetero_sd.loading.default_model as dm

def slow_conversion(gguf, out):  # stands in for the ~90 s conversion: slow enough for the two to overlap
    with open(sys.argv[2], "a") as log:
        log.write("converted\\n")
    time.sleep(1.5)
    tmp = out.with_name(out.name + ".tmp-x")
    tmp.mkdir()
    (tmp / dm._DONE).write_text("done")
    tmp.rename(out)

dm.convert_gguf = slow_conversion
print(dm.ensure_converted(Path(sys.argv[1]), dm.home() / "models" / "M"))
"""


def test_two_first_runs_on_an_empty_home_convert_once(tmp_path):
    home = tmp_path / "home"
    stale = home / "models" / "M.tmp-12345"  # a conversion that was killed earlier
    stale.mkdir(parents=True)
    gguf = prompts_file(tmp_path, b"GGUF" + bytes(16), "m.gguf")
    log = tmp_path / "log"
    env = dict(os.environ, HETERO_SD_HOME=str(home))
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT, str(gguf), str(log)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert log.read_text().splitlines() == ["converted"]  # one conversion; the other waited and reused it
    assert {o[0].strip() for o in outs} == {str(home / "models" / "M")}
    assert not stale.exists()


@pytest.mark.parametrize("failure,expected,message", [
    (ValueError("GGUF model with architecture mamba is not supported yet"), "ConfigError",
     "cannot convert .* architecture mamba is not supported"),
    (KeyboardInterrupt(), "KeyboardInterrupt", None),  # Ctrl-C mid-conversion
])
def test_a_failed_conversion_leaves_no_temp_folder(tmp_path, monkeypatch, failure, expected, message):
    import hetero_sd.loading.default_model as dm
    from hetero_sd.errors import ConfigError

    monkeypatch.setenv("HETERO_SD_HOME", str(tmp_path))

    def broken(gguf, tmp, console):
        (tmp / "model.safetensors").write_text("half")
        raise failure

    monkeypatch.setattr(dm, "write_converted", broken)
    gguf = prompts_file(tmp_path, b"GGUF" + bytes(16), "m.gguf")
    with pytest.raises({"ConfigError": ConfigError, "KeyboardInterrupt": KeyboardInterrupt}[expected], match=message):
        dm.ensure_converted(gguf, tmp_path / "models" / "M")
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["M.lock"]


def test_chat_settings_refuse_a_temperature_that_is_not_finite(tiny_llama):
    import asyncio

    from textual.widgets import Input

    from hetero_sd.tui import ChatApp

    app = ChatApp({"target": str(tiny_llama), "draft": None})

    async def scenario():
        async with app.run_test(size=(80, 24)) as pilot:
            while app.query_one("#prompt").disabled:
                await pilot.pause(0.1)
            for bad in ("nan", "-1", "warm"):
                await pilot.press("ctrl+o")
                await pilot.pause(0.2)
                app.screen.query_one("#temperature", Input).value = bad
                await pilot.click("#apply")
                await pilot.pause(0.2)
                assert app.settings["temperature"] == 0.0  # refused: the dialog stays open
                await pilot.press("escape")
                await pilot.pause(0.1)

    asyncio.run(scenario())
