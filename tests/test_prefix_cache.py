"""The prefix cache (Runtime.prefix_cache, on in `hetero-sd serve`): a new turn of a conversation reuses
the KV cache and the draft's context of the longest prefix a finished generation left, and prefills only
the rest. Lossless: every turn's tokens are those computed without it (T=0; speculative in both
schedules, and autoregressive), and the reused positions are counted in the stats."""

from __future__ import annotations

import pytest

import hetero_sd

START = [5, 9, 12, 20, 7, 33]


@pytest.fixture(scope="module")
def runtime(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed", cpu_threads=1)
    yield rt
    rt.close()


def conversation(rt, cached: bool, turns: int = 5, **kw) -> list[tuple[list[int], int]]:
    """Each turn's prompt is the previous prompt, the answer and the user's next message."""
    rt.prefix_cache = cached
    prompt, out = list(START), []
    try:
        for t in range(turns):
            g = rt.generate(prompt, max_new_tokens=10, **kw)
            out.append((g.token_ids, g.stats.num_cached_tokens))
            prompt = prompt + g.token_ids + [6 + t, 40 + t]
    finally:
        rt.prefix_cache = False
    return out


@pytest.mark.parametrize("kw", [dict(), dict(schedule="overlap"), dict(speculative=False)],
                         ids=["speculative", "overlap", "autoregressive"])
def test_prefix_cache_is_lossless_and_reuses_the_conversation(runtime, kw):
    without = conversation(runtime, False, **kw)
    with_cache = conversation(runtime, True, **kw)
    assert [ids for ids, _ in with_cache] == [ids for ids, _ in without]
    assert all(n == 0 for _, n in without)
    assert with_cache[0][1] == 0
    held = len(START)
    for t in range(1, 5):  # the previous prompt and answer were reused (the answer's last token at least
        held += len(with_cache[t - 1][0])  # is not in the cache: it was never fed back)
        assert with_cache[t][1] >= held - 1, (t, with_cache[t][1], held)
        held += 2


def test_a_different_prompt_reuses_only_the_common_prefix(runtime):
    runtime.prefix_cache = True
    try:
        runtime.generate(START + [8, 8, 8], max_new_tokens=4)
        g = runtime.generate(START + [9, 9], max_new_tokens=4)
        assert g.stats.num_cached_tokens == len(START)
        runtime.prefix_cache = False
        assert runtime.generate(START + [9, 9], max_new_tokens=4).token_ids == g.token_ids
    finally:
        runtime.prefix_cache = False
