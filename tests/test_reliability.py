"""Issue 17: one Runtime shared safely, nothing lost, every bad input refused up front.

Sections: concurrency (threads and interleaved streams against sequential T=0 outputs), the API's
checks, the CLI's (subprocess: exit 2, one `error:` line and a `fix:` line, no traceback), lost work
(bench/generate files, SIGTERM), the model home (lock, stale temp folders, unusable homes)."""

from __future__ import annotations

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
    """The issue's case on the real model: two generations at once, with and without the draft."""
    prompts = ["Tell me about mathematics.", "Name a colour."]
    for speculative in (True, False):
        kw = dict(max_new_tokens=8, speculative=speculative)
        alone = [smollm_random.generate(p, **kw).text for p in prompts]
        assert concurrently(lambda p: smollm_random.generate(p, **kw).text, prompts, threads=2) == alone


def test_closed_runtime_says_so(tiny_llama):
    rt = hetero_sd.load(str(tiny_llama), None)
    rt.close()
    for call in (lambda: rt.generate("t5 t6"), lambda: rt.stream("t5 t6"), lambda: rt.generate_many(["t5"])):
        with pytest.raises(RuntimeClosedError, match="this Runtime was closed"):
            call()
