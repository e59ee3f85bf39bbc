"""`hetero-sd serve` (hetero_sd/server/) against live uvicorn servers on free loopback ports, with the tiny
random target and draft of conftest.py: the official `openai` client (plain and streamed), stop strings
split across tokens, concurrent requests equal to sequential ones at T=0, a client that disconnects
mid-stream (its caches come back), a bounded load test, a full queue (429), bad requests in OpenAI's
error shape, the API key, metrics, and SIGTERM on the real command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import hetero_sd
from hetero_sd.server.stops import StopText

from .live_server import MODEL, Live, free_port

PROMPT = [{"role": "user", "content": "t5 t9 t12 t20"}]


class Slow:
    """The runtime, with each generation step held for 20 ms: a long generation is then surely still
    running when a test hangs up or sends its next request, however fast the machine."""

    def __init__(self, rt):
        self.rt = rt

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def stream(self, *args, **kwargs):
        inner = self.rt.stream(*args, **kwargs)  # checked now, as the runtime does

        def held():
            try:
                for event in inner:
                    time.sleep(0.02)
                    yield event
            finally:
                inner.close()
        return held()


@pytest.fixture(scope="module")
def runtime(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed", cpu_threads=1)  # tiny: 1 thread
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def live(runtime):
    server = Live(runtime)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(runtime, max_tokens: int, messages=PROMPT, **kw):
    """What the runtime alone generates for the same request (T=0 unless told)."""
    ids = runtime.encode(messages)[0]
    return runtime.generate(ids, max_new_tokens=max_tokens, stop_at_eos=True, **kw)


def test_openai_client_plain_and_streamed(runtime, client):
    want = reference(runtime, 24)
    r = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("stop" if want.stats.finish_reason == "stop" else "length")
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(want.prompt_ids)
    spec = r.model_extra["speculative"]
    assert spec["num_drafts"] == want.stats.num_drafts and spec["draft_device"] == "cpu"
    assert spec["tau"] == pytest.approx(want.stats.tau)

    chunks = list(client.chat.completions.create(model=MODEL, messages=PROMPT, max_completion_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    c = client.completions.create(model=MODEL, prompt="t5 t9", max_tokens=10, temperature=0)
    plain = runtime.generate("t5 t9", chat=False, max_new_tokens=10)
    assert c.choices[0].text == plain.text and c.usage.completion_tokens == len(plain.token_ids)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_penalties_and_min_p_reach_the_sampler(runtime, client):
    kw = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, min_p=0.05)
    want = reference(runtime, 20, **kw)
    r = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=20, temperature=0,
                                       presence_penalty=0.5, frequency_penalty=0.4,
                                       extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "top_k": -1})
    assert r.choices[0].message.content == want.text
    assert want.text != reference(runtime, 20).text  # the penalties changed the text


def test_next_turn_reuses_the_conversation(runtime, client):
    first = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, temperature=0)
    convo = PROMPT + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "t7 t8"}]
    second = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    runtime.prefix_cache = False
    try:
        assert second.choices[0].message.content == reference(runtime, 8, convo).text
    finally:
        runtime.prefix_cache = True


def test_stop_text_holds_back_partial_matches():
    s = StopText(["</s>", "xyz"])
    assert s.feed("ab<") == "ab"  # "<" may start "</s>"
    assert s.feed("/") == ""
    assert s.feed("q") == "</q"  # it did not
    assert s.feed("x") == "" and s.feed("yz tail") == "" and s.stopped
    assert StopText(["ab"]).flush() == "" and StopText([]).feed("a") == "a"
    t = StopText(["abc"])
    assert t.feed("xab") == "x" and t.flush() == "ab"


def test_stop_strings_split_across_tokens(runtime, client):
    text = reference(runtime, 30).text
    words = text.split(" ")
    assert len(words) > 5, f"the tiny model should say more than {text!r}"
    # The end of the 3rd token, the space and the start of the 4th: a stop string no token holds.
    cut = len(" ".join(words[:3]))
    stop = text[cut - 1:cut + 3]
    expected = text[:text.find(stop)]
    r = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=30, temperature=0, stop=stop,
                                            stream=True)
    streamed = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(streamed) == expected


def test_concurrent_requests_equal_sequential(client):
    prompts = [[{"role": "user", "content": f"t{5 + i} t{9 + 2 * i} t{40 - i}"}] for i in range(8)]

    def ask(messages):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        return r.choices[0].message.content

    one_by_one = [ask(m) for m in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    assert together == one_by_one


def wait_idle(engine, timeout=20.0):
    deadline = time.time() + timeout
    while engine.jobs or engine.running:
        assert time.time() < deadline, "requests still in flight"
        time.sleep(0.02)


def test_disconnect_mid_stream_cancels_and_frees_caches(runtime):
    live = Live(Slow(runtime))
    wait_idle(live.engine)
    free_before = len(runtime.slots.free)
    cancelled = live.app.state.metrics.request_success.labels(model_name=MODEL, finished_reason="cancelled")
    before = cancelled._value.get()
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 1,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{live.url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few chunks, then hang up
    assert any(line.startswith("data: {") for line in got)
    wait_idle(live.engine)
    assert cancelled._value.get() == before + 1, "the generation ran on after its client left"
    assert len(runtime.slots.free) == free_before, "the cancelled generation kept its caches"
    live.stop()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_client_gone_before_a_whole_reply_cancels_it(runtime, route):
    """Not streamed: the client gives up waiting; the generation stops and gives its caches back (OpenAI's
    route and Anthropic's alike)."""
    long = [{"role": "user", "content": "t5 t5"}]  # the tiny target's greedy answer to it runs ~260 tokens
    assert len(reference(runtime, 300, long).token_ids) >= 100  # at 20 ms a step: running when the client leaves
    live = Live(Slow(runtime))
    wait_idle(live.engine)
    free_before = len(runtime.slots.free)
    cancelled = live.app.state.metrics.request_success.labels(model_name=MODEL, finished_reason="cancelled")
    before = cancelled._value.get()
    with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post(f"{live.url}{route}", json={"model": MODEL, "messages": long, "max_tokens": 300, "temperature": 0})
    wait_idle(live.engine)
    assert cancelled._value.get() == before + 1, "the generation ran on after its client left"
    assert len(runtime.slots.free) == free_before
    live.stop()


def test_bounded_load(live):
    """16 clients x 4 requests within a fixed time: every response complete, no error."""
    def client_run(n):
        done = []
        with httpx.Client(timeout=60) as http:
            for k in range(4):
                r = http.post(f"{live.url}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": f"t{n + 4} t{k + 10}"}],
                                    "max_tokens": 8, "temperature": 0.8, "seed": n * 4 + k})
                assert r.status_code == 200, r.text
                doc = r.json()
                assert doc["choices"][0]["finish_reason"] in ("stop", "length")
                assert 1 <= doc["usage"]["completion_tokens"] <= 8
                done.append(doc)
        return done

    began = time.time()
    with ThreadPoolExecutor(16) as pool:
        results = [d for batch in pool.map(client_run, range(16)) for d in batch]
    assert len(results) == 64 and time.time() - began < 90


def test_full_queue_answers_429(runtime):
    server = Live(Slow(runtime), workers=1, queue=0)
    try:
        long = {"messages": PROMPT, "max_tokens": 400, "temperature": 1.0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server.url}/v1/chat/completions", json=long) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)
                state = (len(server.engine.jobs), server.engine.running)
                busy = http.post(f"{server.url}/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2})
                rest = list(lines)
            assert busy.status_code == 429, (state, rest[:2], rest[-3:])
            assert busy.json()["error"]["code"] == "queue_full"
            wait_idle(server.engine)
            assert http.post(f"{server.url}/v1/chat/completions",
                             json={"messages": PROMPT, "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("body, status, param", [
    (b'{"messages": [', 400, None),  # malformed JSON
    (b'[1, 2]', 400, None),
    ({"messages": PROMPT, "logprobs": True, "top_logprobs": 2}, 400, "logprobs"),  # unknown / unsupported fields
    ({"messages": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"messages": PROMPT, "temperature": "0.5"}, 400, "temperature"),  # no coercion
    ({"messages": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"messages": PROMPT, "n": 2}, 400, "n"),
    ({"messages": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "t5 " * 600}]}, 400, "messages"),  # longer than the context
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "t5"}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"messages": PROMPT, "stop": 5}, 400, "stop"),
    ({"messages": PROMPT, "min_p": 2}, 400, "min_p"),
    ({"messages": PROMPT, "chat_template_kwargs": {"x": 1}}, 400, "chat_template_kwargs"),  # no template here
    ({"messages": PROMPT, "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_openai_shaped_errors(live, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{live.url}/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert "Traceback" not in r.text


def test_oversize_completion_prompt_and_bad_prompt(live):
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "t5 " * 600}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": [999999]}, timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_api_key(runtime):
    server = Live(runtime, api_key="sekret")
    try:
        url = f"{server.url}/v1/models"
        assert httpx.get(url).status_code == 401
        wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url, headers={"Authorization": "Bearer sekret"}).status_code == 200
        ok = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    finally:
        server.stop()


def test_chat_template_over_the_whole_conversation(runtime, client):
    """System, user and assistant turns all go through the template, with chat_template_kwargs."""
    template = ("{% for m in messages %}{{ {'system': 't4', 'user': 't5', 'assistant': 't6'}[m['role']] }} "
                "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t6{% endif %}{% if extra %} t7{% endif %}")
    old, runtime.tokenizer.chat_template = runtime.tokenizer.chat_template, template
    try:
        convo = [{"role": "system", "content": "t30"}, {"role": "user", "content": "t31 t32"},
                 {"role": "assistant", "content": "t33"}, {"role": "user", "content": "t34"}]
        ids = runtime.tokenizer.encode("t4 t30 t5 t31 t32 t6 t33 t5 t34 t6", add_special_tokens=False)
        want = runtime.generate(ids, max_new_tokens=12, stop_at_eos=True)
        r = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=12, temperature=0)
        assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == want.text
        r = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=12, temperature=0,
                                           extra_body={"chat_template_kwargs": {"extra": True}})
        assert r.usage.prompt_tokens == len(ids) + 1
    finally:
        runtime.tokenizer.chat_template = old


def test_metrics_text(live, client):
    client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=6, temperature=0)
    text = httpx.get(f"{live.url}/metrics").text
    for name in ("hetero_sd:spec_decode_num_drafts_total", "hetero_sd:spec_decode_num_draft_tokens_total",
                 "hetero_sd:spec_decode_num_accepted_tokens_total", "hetero_sd:generation_tokens_total",
                 "hetero_sd:prompt_tokens_total", "hetero_sd:request_success_total",
                 "hetero_sd:time_to_first_token_seconds_bucket", "hetero_sd:num_requests_running"):
        assert name in text, name
    drafts = [line for line in text.splitlines() if line.startswith("hetero_sd:spec_decode_num_drafts_total")]
    assert float(drafts[0].split()[-1]) > 0


def until_healthy(proc, url: str, seconds: float = 60) -> None:
    """Until the `serve` child at url answers /health (its stdout in the failure if it exits first)."""
    deadline = time.time() + seconds
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not come up"
        time.sleep(0.2)


def test_sigterm_finishes_and_exits(tiny_llama, tiny_draft, tmp_path):
    """The real command: SIGTERM while a stream is in flight; the stream ends and the process exits 0."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "hetero_sd.cli", "serve", "--target", str(tiny_llama),
                             "--draft", str(tiny_draft), "--block-size", "fixed", "--threads", "1", "--port", str(port),
                             "--shutdown-timeout", "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        until_healthy(proc, url)
        body = {"messages": PROMPT, "max_tokens": 400, "temperature": 1.0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the stream ends: finished, or cancelled with an error event, then [DONE]
        assert "data: [DONE]" in rest, rest[-3:]
        assert proc.wait(30) == 143  # the project's status for SIGTERM, after a clean shutdown
        assert "stopped cleanly" in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("warms", [True, False])
def test_serve_warms_its_steps_before_it_listens(tiny_llama, tiny_draft, monkeypatch, capsys, warms):
    """Where a step shape costs something on its first use (Runtime.warms: captured or compiled steps; here the
    fixed-shape steps a GPU captures, said to), `serve` runs every shape of its caches before it takes a request,
    and says so; where none does, nothing."""
    import hetero_sd.server
    from hetero_sd.cli.main import main
    from hetero_sd.runtime import Runtime

    ran, real_warm, free = [], Runtime.warm, []
    monkeypatch.setenv("HETERO_SD_FUSED", "off")
    monkeypatch.setenv("HETERO_SD_QUANT", "off")
    monkeypatch.setenv("HETERO_SD_STEPS", "fixed")
    monkeypatch.setattr(Runtime, "warms", lambda self: warms)
    monkeypatch.setattr(Runtime, "warm", lambda self, *a, **k: ran.append(real_warm(self, *a, **k)) or
                        free.append(len(self.slots.free)) or ran[-1])
    monkeypatch.setattr(hetero_sd.server, "serve", lambda rt, settings, **kw: 0)  # (listening: not this test's)
    assert main(["serve", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--port", "0"]) == 0
    err = capsys.readouterr().err
    warmed, listening = err.find("step shapes ready in"), err.find("serving ")
    assert listening >= 0 and (0 <= warmed < listening) is warms and (len(ran) == 1 and ran[0] > 0) is warms, err
    assert free == ([4] if warms else [])  # a pair for each of the 4 requests at once (--workers' default)


@pytest.mark.parametrize("argv, says", [(["--port", "70000"], "--port 70000"),
                                        (["--schedule", "pipeline"], "--schedule pipeline"),
                                        (["--workers", "0"], "--workers"), (["--top-p", "2"], "--top-p")])
def test_serve_flags_are_checked_before_loading(argv, says, capsys):
    from hetero_sd.cli.main import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "fix:" in err
