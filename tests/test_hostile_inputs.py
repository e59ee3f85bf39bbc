"""What a careless or malicious user sends is answered with a one-line error (before any model loads where
the input allows it) or a bounded cost, never a hang, a traceback or silence: the CLI through its entry
point, the Python API, and `hetero-sd serve`'s limits over HTTP on 127.0.0.1 (a 300 MB body answered 413
with the server's memory measured, a half-sent request closed by the header timeout while other clients
are served, a stalled body answered 408)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

import hetero_sd
from hetero_sd.cli.main import main
from hetero_sd.errors import ConfigError, InvalidArgumentError

from .live_server import Live

CLI = [sys.executable, "-m", "hetero_sd.cli"]
PROMPT = [{"role": "user", "content": "t5 t9 t12 t20"}]


def refused(argv: list[str], capsys, *says: str) -> str:
    """main(argv) exits 2 with one error/fix pair naming every `says`, and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "fix:" in err and "Traceback" not in err, err
    for text in says:
        assert text in err, err
    return err


def run_cli(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed command in a child process: a hang fails the test at `timeout` instead of holding it."""
    return subprocess.run(CLI + argv, capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
                          stdin=subprocess.DEVNULL)


# --- the command line ---------------------------------------------------------------------------------

def test_random_draft_layer_count_is_bounded_before_building(tiny_llama):
    started = time.perf_counter()
    out = run_cli(["generate", "t5", "--target", str(tiny_llama), "--draft", "random:99999"], timeout=90)
    assert out.returncode == 2, out.stderr
    assert "random:99999" in out.stderr and "1 to 64 layers" in out.stderr and "Traceback" not in out.stderr
    assert time.perf_counter() - started < 60
    with pytest.raises(InvalidArgumentError, match="1 to 64 layers"):
        hetero_sd.load(str(tiny_llama), "random:0")


@pytest.mark.parametrize("flag, value", [("--draft-device", "ane-sim"), ("--block-size", "4"),
                                         ("--verify-gate", "0.3"), ("--draft-dtype", "float32")])
def test_autoregressive_refuses_draft_flags(tiny_llama, tiny_draft, capsys, flag, value):
    refused(["generate", "t5", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--autoregressive",
             flag, value], capsys, "--autoregressive", flag)


@pytest.fixture(scope="module")
def inconsistent_target(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("inconsistent") / "target"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=640, num_attention_heads=9)
    config.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_inconsistent_target_config_is_one_line(inconsistent_target, capsys):
    refused(["generate", "t5", "--target", str(inconsistent_target), "--draft", "none"], capsys,
            "config.json is inconsistent", "640", "(9)")
    with pytest.raises(ConfigError, match="is inconsistent"):
        hetero_sd.load(str(inconsistent_target), None)


def test_draft_vocab_refuses_an_existing_file_as_out(tiny_draft, tmp_path, capsys):
    existing = tmp_path / "README.md"
    existing.write_text("keep me\n")
    refused(["draft-vocab", "--draft", str(tiny_draft), "--k", "8", "--out", str(existing)], capsys,
            f"--out {existing} is a file")
    assert existing.read_text() == "keep me\n"


def test_draft_with_an_object_array_lookup_table(tiny_llama, tiny_draft, tmp_path, capsys):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    np.savez(draft / "lookup_corpus.npz", keys2=np.array([{"a": 1}], dtype=object),
             next2=np.zeros(1, np.int32), freq2=np.zeros(1, np.float16))
    refused(["generate", "t5", "--target", str(tiny_llama), "--draft", str(draft), "--max-new-tokens", "2"],
            capsys, "lookup_corpus.npz cannot be read", "draft-lookup")


def test_train_draft_checks_the_device_before_any_data(tiny_llama, tmp_path, capsys, monkeypatch):
    import hetero_sd.train.command as command

    def began(*args, **kwargs):
        raise AssertionError("train-draft began its work before checking --device")

    for name in ("resolve_target", "generate_responses", "train_on"):
        monkeypatch.setattr(command, name, began)
    refused(["train-draft", "--target", str(tiny_llama), "--device", "tpu", "--out", str(tmp_path / "d"),
             "--prompts", "2"], capsys, "--device tpu")


@pytest.mark.parametrize("extra, says", [
    (["--temperature", "1e308"], "temperature 1e+308 is above 2"),
    (["--json", ""], "--json is empty"),
    (["--trace", ""], "--trace is empty"),
    (["--no-chat", "--system-prompt", "be brief"], "--system-prompt"),
    (["--no-chat", "--chat-template-kwargs", "{}"], "--chat-template-kwargs"),
])
def test_generate_refuses_silent_flags(tiny_llama, tiny_draft, capsys, extra, says):
    refused(["generate", "t5", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--max-new-tokens", "2",
             *extra], capsys, says)


@pytest.mark.parametrize("extra, says", [
    (["--prompts", "PROMPTS", "--dataset", "chat", "--limit", "1"], "both name the prompts"),
    (["--costs", "--blocks", "4"], "--costs runs the cost probe alone, so --blocks"),
    (["--costs", "--dataset", "chat"], "--dataset would be ignored"),
    (["--temperature", "0,1e308"], "temperature 1e+308 is above 2"),
])
def test_bench_refuses_ignored_flags(tiny_llama, tiny_draft, tmp_path, capsys, extra, says):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5 t6"}\n')
    extra = [str(prompts) if e == "PROMPTS" else e for e in extra]
    refused(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--max-new-tokens", "2", *extra],
            capsys, says)


@pytest.mark.parametrize("extra, says", [(["--served-model-name", ""], "--served-model-name is empty"),
                                         (["--served-model-name", "  "], "--served-model-name is empty"),
                                         (["--host", "not a host!"], "--host 'not a host!'"),
                                         (["--api-key", ""], "--api-key is empty"),
                                         (["--temperature", "1e308"], "above 2")])
def test_serve_refuses_before_the_model_loads(tiny_llama, tiny_draft, extra, says):
    """In a child process: today's alternative is a server that loads and then runs (or fails) on its own."""
    out = run_cli(["serve", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--port", "0", *extra],
                  timeout=90)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "fix:" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "serving" not in out.stderr  # refused before the model loaded and the URL was printed


@pytest.mark.parametrize("argv, says", [(["--max-body-bytes", "0"], "--max-body-bytes"),
                                        (["--header-timeout", "0"], "--header-timeout"),
                                        (["--body-timeout", "nan"], "--body-timeout"),
                                        (["--keep-alive-timeout", "-1"], "--keep-alive-timeout")])
def test_serve_limit_flags_are_checked(argv, says, capsys):
    refused(["serve", *argv], capsys, says)


def test_serve_help_documents_the_limits():
    out = run_cli(["serve", "--help"], timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in ("--max-body-bytes", "--header-timeout", "--body-timeout", "--keep-alive-timeout"):
        assert flag in text
    assert "answered 413" in text and "16,777,216" in text


# --- the Python API -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runtime(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed", cpu_threads=1)
    yield rt
    rt.close()


@pytest.mark.parametrize("call, says", [
    (lambda rt: rt.generate("t5", timeline="x", max_new_tokens=2), "timeline must be a Timeline"),
    (lambda rt: rt.generate([{"role": "hacker", "content": "t5"}], max_new_tokens=2), "role 'hacker'"),
    (lambda rt: rt.generate("t5", stop_at_eos="no", max_new_tokens=2), "stop_at_eos must be True or False"),
    (lambda rt: rt.generate(PROMPT, chat=False, max_new_tokens=2), "list of messages"),
    (lambda rt: rt.stream(PROMPT, chat="no", max_new_tokens=2), "chat must be True or False"),
    (lambda rt: rt.generate("t5", temperature=1e308, max_new_tokens=2), "temperature 1e+308 is above 2"),
])
def test_api_refuses_wrong_arguments(runtime, call, says):
    with pytest.raises(InvalidArgumentError, match=says.replace("(", r"\(").replace("+", r"\+")):
        call(runtime)


def test_api_still_takes_what_it_documents(runtime):
    """The refusals above leave the documented forms working: a Timeline, a bool, a tool message."""
    from hetero_sd.decoding.timeline import Timeline

    timeline = Timeline()
    out = runtime.generate("t5 t9", timeline=timeline, stop_at_eos=False, max_new_tokens=3)
    assert out.stats.timeline is timeline and out.stats.num_generated_tokens == 3
    assert runtime.generate("t5 t9", chat=False, temperature=2.0, seed=1, max_new_tokens=2).token_ids


# --- the server over HTTP on 127.0.0.1 ------------------------------------------------------------------

LIMIT = 1024 * 1024  # the test server's body limit (the default is 16 MiB; the mechanism is the same)


class Unclosing:
    """The module's runtime, whose close() (the server's shutdown closes its runtime) is left to the fixture."""

    def __init__(self, rt):
        self.rt = rt

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def close(self):
        pass


@pytest.fixture(scope="module")
def server(runtime):
    s = Live(Unclosing(runtime), header_timeout=1.0, max_body_bytes=LIMIT, body_timeout=1.0)
    yield s
    s.stop()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """This process's resident memory sampled every 5 ms; `growth` is the peak above the start."""

    def __enter__(self):
        self.start, self.peak, self.done = rss(), rss(), False
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while not self.done:
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


class Others:
    """Another client asking /health over and over while a test misbehaves on its own connection."""

    def __init__(self, url: str):
        self.url, self.answered, self.failed, self.done = url, 0, [], False
        self.thread = threading.Thread(target=self.ask, daemon=True)

    def ask(self):
        while not self.done:
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                self.answered += r.status_code == 200
            except httpx.HTTPError as e:
                self.failed.append(repr(e))
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done = True
        self.thread.join(10)


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=15)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    return s


def read_reply(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after its reply counts as closing)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


BIG = 300 * 1000 * 1000
CHUNK = b"x" * (1024 * 1024)


def test_a_declared_300mb_body_is_answered_413_unread(server):
    with PeakMemory() as memory, Others(server.url) as others, connect(server.port) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % BIG)
        reply = read_reply(s)  # before a byte of the body is sent
        sent = 0
        try:  # the server has closed: the body finds no reader
            while sent < BIG:
                s.sendall(CHUNK)
                sent += len(CHUNK)
        except (BrokenPipeError, ConnectionResetError):
            pass
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and "1,048,576 bytes" in error["message"]
    assert sent < 64 * len(CHUNK), f"the server read {sent:,} bytes of a body it had refused"
    assert memory.growth < 64 * 1024 * 1024, f"memory grew by {memory.growth:,} bytes"
    assert others.answered and not others.failed


def test_a_streamed_300mb_body_is_cut_off_at_the_limit(server):
    """No Content-Length (chunked): the body is counted as it arrives and refused once past the limit."""
    sent, reply = 0, b""
    with PeakMemory() as memory, Others(server.url) as others, connect(server.port) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < BIG:
                s.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                sent += len(CHUNK)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_reply(s)
    assert sent < 64 * len(CHUNK), f"the server took {sent:,} bytes of a {LIMIT:,}-byte limit"
    assert not reply or reply.startswith(b"HTTP/1.1 413"), reply[:300]  # the reply may be lost to the reset
    assert memory.growth < 64 * 1024 * 1024, f"memory grew by {memory.growth:,} bytes"
    assert others.answered and not others.failed
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text  # a body within the limit is served as before


def test_a_half_sent_request_is_closed_by_the_header_timeout(server):
    with Others(server.url) as others:
        with connect(server.port) as silent, connect(server.port) as partial:
            partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
            started = time.perf_counter()
            reply = read_reply(partial)
            waited = time.perf_counter() - started
            assert read_reply(silent) == b""  # nothing sent, nothing answered: closed
        time.sleep(0.3)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert waited < 10
    assert others.answered and not others.failed  # served while the two connections hung


def test_a_stalled_body_is_answered_408(server):
    with connect(server.port) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"messages\": ")
        started = time.perf_counter()
        reply = read_reply(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"serve --body-timeout" in reply and time.perf_counter() - started < 10


@pytest.mark.parametrize("body, param", [
    ({"messages": PROMPT, "temperature": 1e308}, "temperature"),
    ({"messages": PROMPT, "temperature": 2.5}, "temperature"),
    ({"messages": PROMPT, "stop": ""}, "stop"),
    ({"messages": PROMPT, "stop": ["t9", ""]}, "stop"),
    ({"messages": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": PROMPT, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_server_refuses_silent_fields(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_server_stream_options_with_stream_still_counts_usage(server):
    body = {"messages": PROMPT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
