"""The loop rule (hetero_sd/bench/repetition.py) on hand-made answers."""

from __future__ import annotations

import pytest

from hetero_sd.bench.repetition import LOOP_NGRAM, add_counts, loop_counts, loop_figures, loop_mask, step_lengths


def test_a_token_is_a_loop_token_once_its_ngram_repeats():
    assert LOOP_NGRAM == 8
    fresh = list(range(10))
    assert loop_mask(fresh) == [False] * 10
    answer = fresh + fresh  # the second copy: its first 7 tokens start 8-grams not seen, then all repeat
    assert loop_mask(answer) == [False] * 17 + [True] * 3
    assert loop_mask([7] * 12) == [False] * 8 + [True] * 4  # a one-token loop
    assert loop_mask([1, 2, 1, 2], n=2) == [False, False, False, True]


def test_step_lengths_follow_the_emitted_tokens():
    # prefill token, then steps accepting 3, 0, 2 drafts; the last step cut by the length limit
    assert step_lengths([3, 0, 2], 1 + 4 + 1 + 2) == [4, 1, 2]
    assert step_lengths([3, 0, 5], 1 + 4 + 1 + 6) == [4, 1, 6]


def test_loop_free_tau_splits_steps_by_their_tokens():
    ids = [1, 2, 3, 1, 2, 3, 1]  # shorter than an 8-gram: nothing can repeat
    c = loop_counts(ids, [3, 3])
    assert c == {"tokens": 7, "loop_tokens": 0, "steps": 2, "step_tokens": 6, "free_step_tokens": 6, "free_steps": 2}
    answer = list(range(10)) * 2 + [99]  # tokens 17..19 are loop tokens
    c = loop_counts(answer, [16, 4])  # step 1: tokens 1..16 (free), step 2: tokens 17..20 (3 loop, 1 free)
    assert c["loop_tokens"] == 3 and c["free_step_tokens"] == 17 and c["free_steps"] == pytest.approx(1.25)
    f = loop_figures(c, speedup=2.0)
    assert f["loop_share"] == pytest.approx(3 / 21)
    assert f["tau_all"] == 10 and f["tau_loop_free"] == pytest.approx(17 / 1.25)
    assert f["speedup_loop_free"] == pytest.approx(2.0 * (17 / 1.25) / 10)
    pooled = loop_figures(add_counts([c, loop_counts(list(range(5)), [4])]))
    assert pooled["tau_loop_free"] == pytest.approx(21 / 2.25)


def test_counts_without_steps_give_the_share_and_no_tau():
    """No speculative step (autoregressive, or the controller decoded plainly): the share, and tau named
    as unknown rather than left out (readers of the JSON find the keys)."""
    f = loop_figures(add_counts([loop_counts([5] * 10), loop_counts(list(range(10)))]))
    assert f == {"loop_share": pytest.approx(2 / 20), "tau_all": None, "tau_loop_free": None}
