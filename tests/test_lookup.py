"""The context lookup mixed into the draft's proposals (decoding/lookup.py): its guesses, when they replace
the draft's own token, and that decoding stays lossless with it (T=0 here; T>0: test_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from hetero_sd.decoding.lookup import CORPUS_FILE, ContextLookup, CorpusTable

from .doubles import with_draft
from .test_lossless import MAX_NEW, PROMPTS, baselines  # noqa: F401 (the fixture)


def test_the_guess_is_what_followed_the_latest_earlier_occurrence_of_the_longest_match():
    seen = ContextLookup([1, 2, 9, 5, 1, 2, 7, 6, 1, 2])
    assert seen.guess() == 7  # (1, 2) was followed by 9, then by 7: the latest wins
    seen = ContextLookup([4, 1, 2, 9, 3, 1, 2, 7, 4, 1, 2])
    assert seen.guess() == 9  # the 3-gram (4, 1, 2) was followed by 9, though (1, 2) last by 7
    assert ContextLookup([1, 2, 3]).guess() is None  # no earlier occurrence of (2, 3) or (1, 2, 3)
    assert ContextLookup([5, 1, 5, 2]).guess() is None  # a 1-token match is not used
    seen = ContextLookup([1, 2, 9, 8])
    assert seen.guess(drafted=[1, 2]) == 9  # drafted tokens extend the context they are guessed after
    seen.extend([1, 2, 3])
    assert seen.guess() is None and seen.guess(drafted=[1, 2]) == 3


def test_a_guess_replaces_the_drafts_token_only_where_the_draft_is_unsure():
    seen = ContextLookup([1, 2, 9, 8, 1, 2], weight=0.4)
    sure = torch.full((1, 12), -10.0)
    sure[0, 5] = 5.0  # q(5) ~ 1: the guess 9 would need 0.6 q(9) + 0.4 > 0.6 q(5)
    assert seen.steer(sure, [5]) == [5] and seen.steered == 0
    unsure = torch.zeros(1, 12)
    unsure[0, 5] = 1.0  # q(5) ~ 0.2, q(9) ~ 0.07
    assert seen.steer(unsure, [5]) == [9] and seen.steered == 1
    assert ContextLookup([1, 2, 9, 8, 1, 2], weight=0.0).steer(unsure, [5]) == [5]
    # row 1's guess follows row 0's proposal: after (2, 9) came 8
    assert seen.steer(torch.zeros(2, 12), [5, 5]) == [9, 8]


def test_mixed_proposals_put_the_weight_on_the_guess():
    seen = ContextLookup([1, 2, 9, 8, 1, 2], weight=0.25)
    q = torch.softmax(torch.randn(2, 12, generator=torch.Generator().manual_seed(0)), -1)
    tokens, mixed = seen.mix(q, lambda probs, i: int(probs[0].argmax()))
    assert torch.allclose(mixed.sum(-1), torch.ones(2))
    assert mixed[0, 9] == pytest.approx(0.75 * q[0, 9].item() + 0.25)
    assert torch.allclose(mixed[0, :9], 0.75 * q[0, :9])
    assert torch.equal(q, torch.softmax(torch.randn(2, 12, generator=torch.Generator().manual_seed(0)), -1))  # q untouched


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
def test_decoding_with_a_strong_lookup_stays_lossless(smollm_random, baselines, schedule):  # noqa: F811
    """A random draft is unsure everywhere, so at weight 0.9 every guess the lookup has replaces its token:
    the target still emits exactly its own greedy tokens (and a repetitive answer gives the lookup guesses)."""
    rt = with_draft(smollm_random, smollm_random.draft, schedule)
    for prompt in PROMPTS[:2]:
        spec = rt.generate(prompt, max_new_tokens=MAX_NEW, lookup=0.9)
        assert spec.token_ids == baselines[prompt].token_ids
        assert spec.stats.lookup_weight == 0.9
    off = rt.generate(PROMPTS[0], max_new_tokens=MAX_NEW, lookup=0)
    assert off.token_ids == baselines[PROMPTS[0]].token_ids and off.stats.lookup_drafts == 0
    repeated = "Say 'one two three' five times: one two three, one two three,"
    base = smollm_random.generate(repeated, max_new_tokens=MAX_NEW, speculative=False)
    spec = rt.generate(repeated, max_new_tokens=MAX_NEW, lookup=0.9)
    assert spec.token_ids == base.token_ids and spec.stats.lookup_drafts > 0


def test_a_bad_lookup_weight_is_refused_with_the_fix(smollm_random):
    from hetero_sd.errors import InvalidArgumentError

    for bad in (1.0, -0.1, "0.4", True):
        with pytest.raises(InvalidArgumentError, match="lookup weight"):
            list(smollm_random.stream("hi", max_new_tokens=2, lookup=bad))


def force_lookup_blocks(monkeypatch, draft_blocks: int = 0):
    """The controller takes a lookup block wherever the text repeats and the lookup has a guess; with
    draft_blocks=b, a draft block of b everywhere else and after every lookup block (never plain)."""
    from hetero_sd.decoding.controller import AutoBlock

    def lookup_block(self, speeds):
        guesses = self.lookup.chain(self.max_size - 1) if self.lookup is not None and self.repeats.last else []
        if draft_blocks and self.via_lookup_last:
            guesses = []
        self.via_lookup_last = bool(guesses)
        return len(guesses) + 1 if guesses else 0
    monkeypatch.setattr(AutoBlock, "via_lookup_last", False, raising=False)
    monkeypatch.setattr(AutoBlock, "best_lookup", lookup_block)
    if draft_blocks:
        monkeypatch.setattr(AutoBlock, "best", lambda self: draft_blocks)


@pytest.mark.slow
def test_lookup_blocks_stay_lossless(smollm_random, baselines, monkeypatch):  # noqa: F811
    """Blocks of the lookup's guesses alone (no draft pass) between draft blocks and plain steps: the draft's
    context catches up on every position a lookup block verified, and the output is the target's own."""
    import hetero_sd

    force_lookup_blocks(monkeypatch, draft_blocks=4)
    rt = hetero_sd.load("default", "random", block_size="auto")
    repeated = "Say 'one two three' five times: one two three, one two three,"
    base = smollm_random.generate(repeated, max_new_tokens=MAX_NEW, speculative=False)
    for prompt, want in [(repeated, base.token_ids), (PROMPTS[0], baselines[PROMPTS[0]].token_ids)]:
        spec = rt.generate(prompt, max_new_tokens=MAX_NEW)
        assert spec.token_ids == want
    spec = rt.generate(repeated, max_new_tokens=MAX_NEW)
    assert spec.token_ids == base.token_ids and 0 < spec.stats.lookup_blocks < spec.stats.num_drafts


def test_the_controller_takes_a_lookup_block_where_it_is_cheaper_and_as_right():
    from hetero_sd.decoding.controller import AutoBlock, Memory
    from hetero_sd.decoding.costs import Costs

    costs = Costs(decode_s=1.0, verify_s={1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}, draft_s={2: 0.4, 4: 0.5, 8: 0.6})
    seen = ContextLookup([1, 2, 3, 4, 1, 2, 3])
    policy = AutoBlock(8, Memory(costs, 8, learn_costs=False), [1, 2, 3, 4, 1, 2, 3], lookup=seen)
    policy.emitted([4])  # (the loop tells both)
    seen.extend([4])
    for _ in range(20):  # the draft is right at every position: long blocks pay
        policy.observe(8, 7, 7, 1.0)
    # the guesses 1, 2, 3, 4, ... (the cycle goes on): a block of 8 without the draft pass beats the draft's
    assert policy.repeats.last and policy.best_lookup(policy.speeds()) == 8
    assert policy.choose() >= 2 and policy.via_lookup and policy.lookup_blocks == 1
    policy.block_run = policy.PLAIN_CHECK_AFTER + 1  # a plain check falls due: it wins, and is not a lookup block
    assert policy.choose() == 1 and not policy.via_lookup and policy.lookup_blocks == 1
    policy.repeats.last = False  # no repeat at the anchor: no lookup block
    assert policy.best_lookup(policy.speeds()) == 0


# --- the corpus table (hetero-sd draft-lookup) ------------------------------------------------------------

def test_the_corpus_table_keeps_each_contexts_most_frequent_successor(tmp_path):
    table = CorpusTable.build([([1, 2], [3, 4, 5, 3, 4, 6, 3, 4, 5]), ([9], [3, 4, 5, 7])])
    assert table.guess([3, 4]) == (5, 0.75)  # 3 of its 4 successors
    assert table.guess([9, 3, 4]) == (5, 0.75)  # (9, 3, 4) was seen once: the 2-token context answers
    assert table.guess([3, 4, 5])[0] == 3  # a tie between 3 and 7: the smaller id
    assert table.guess([8, 8]) is None
    table.save(tmp_path / "t.npz")
    again = CorpusTable.load(tmp_path / "t.npz")
    assert again.guess([3, 4]) == (5, 0.75) and len(again) == len(table) == 3  # (3, 4), (4, 5), (3, 4, 5)


def test_a_corpus_guess_joins_the_context_guess_with_its_frequency():
    table = CorpusTable.build([([], [7, 8, 9] * 3)])  # (7, 8) -> 9 every time
    seen = ContextLookup([5, 7, 8], weight=0.4, corpus=table)
    assert seen.guesses([]) == {9: pytest.approx(0.2)}  # no earlier (7, 8) in the context: the corpus alone
    seen.extend([9, 7, 8])
    assert seen.guesses([]) == {9: pytest.approx(0.6)}  # both guess 9: the weights add
    assert seen.steer(torch.zeros(1, 12), [5]) == [9]
    assert seen.chain(2) == [9, 7]  # a lookup block takes the context's guesses alone


def test_draft_lookup_writes_the_table_beside_the_draft_from_the_training_rows(tiny_llama, tiny_draft, tmp_path,
                                                                              monkeypatch):
    import shutil

    import hetero_sd
    import hetero_sd.train.distill as distill
    from hetero_sd.cli.main import main

    rows = [{"key": f"k{i}", "index": i, "prompt_ids": [1, 2], "response_ids": [7, 8, 9] * 3} for i in range(5)]
    rows.append({"key": "held", "index": 5, "prompt_ids": [1], "response_ids": [7, 8, 3] * 9})
    monkeypatch.setattr(distill, "load_distilled", lambda folder, target: rows)
    monkeypatch.setattr("hetero_sd.train.trainer.split_held_out",
                        lambda rs, n, seed: ([r for r in rs if r["key"] == "held"][:n], [r for r in rs if r["key"] != "held"]))
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    assert main(["draft-lookup", "--draft", str(draft), "--target", str(tiny_llama), "--distill", str(tmp_path)]) == 0
    table = CorpusTable.load(draft / CORPUS_FILE)
    assert table.guess([7, 8]) == (9, 1.0)  # the held-out row's (7, 8) -> 3 was not counted
    rt = hetero_sd.load(str(tiny_llama), str(draft))
    assert rt.corpus is not None and any("corpus table" in n for n in rt.notes)
    assert main(["draft-lookup", "--draft", str(draft), "--target", str(tiny_llama), "--distill", str(tmp_path),
                 "--min-count", "0"]) == 2
