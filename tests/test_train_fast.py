"""The fast training path: the split-attention forward is the inference draft's forward, the chunked loss
is the plain cross-entropy (value and gradient), features on disk are the features computed, and a
checkpoint is loaded without running code."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from hetero_sd.backends.torch_backend import load_draft, load_target
from hetero_sd.models.config import ArchConfig, DraftConfig, read_json
from hetero_sd.models.draft_init import draft_config, write_draft
from hetero_sd.models.weights import load_weights
from hetero_sd.train.fast import SplitForward, supports
from hetero_sd.train.model import TrainingDraft
from hetero_sd.train.trainer import init_from_target


def trained_like(tiny_llama, block=5, group=2):
    tcfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(tcfg, num_layers=2, block_size=block, mask_token_id=3, layer_ids=[0, 1])
    target = load_target(tiny_llama, tcfg, "cpu", torch.float32, [0, 1])
    model = TrainingDraft(raw, target.embed, target.lm_head.t())
    init_from_target(model, load_weights(tiny_llama), tcfg.num_hidden_layers)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # leave the exact copy so every tensor matters
    return raw, target, model


def test_split_forward_is_the_inference_forward(tmp_path, tiny_llama):
    """Every anchor of a sequence, unsorted, in groups smaller than the block count: each block's logits are
    the runtime draft's `propose` on the context before its anchor."""
    raw, target, model = trained_like(tiny_llama)
    assert supports(model.cfg)
    folder = write_draft(tmp_path / "d", raw, dict(model.state_dict()), dtype=torch.float32)
    draft = load_draft(folder, DraftConfig.from_folder(folder), target, "cpu", torch.float32, 3)
    tokens, features = torch.randint(0, 64, (30,)), torch.randn(30, 2 * 64)
    anchors = torch.tensor([20, 3, 12, 13, 27, 7, 1])
    with torch.no_grad():
        fast = model.logits(SplitForward(model, group=3)(features, tokens, anchors))
        dense = model.logits(model(features, tokens, anchors))
    torch.testing.assert_close(fast, dense, rtol=1e-4, atol=1e-4)
    for row, anchor in enumerate(anchors.tolist()):
        draft.crop(0)
        draft.add_context(features[:anchor])
        torch.testing.assert_close(fast[row], draft.propose(int(tokens[anchor])), rtol=1e-4, atol=1e-4)


def test_short_blocks_train_what_a_shorter_propose_runs(tmp_path, tiny_llama):
    """A block of length L < B (--short-blocks): its first L-1 logits are the runtime's `propose(size=L)`
    (what the block-size controller drafts), not the full block's; the loss reads only those positions."""
    import random
    from hetero_sd.train.trainer import block_labels, block_lengths
    raw, target, model = trained_like(tiny_llama)
    raw["dflash_config"]["short_blocks"] = True  # what train() writes with --short-blocks: propose runs L rows
    folder = write_draft(tmp_path / "d", raw, dict(model.state_dict()), dtype=torch.float32)
    draft = load_draft(folder, DraftConfig.from_folder(folder), target, "cpu", torch.float32, 3)
    tokens, features = torch.randint(0, 64, (30,)), torch.randn(30, 2 * 64)
    anchors, lengths = torch.tensor([20, 3, 12, 13, 27, 7]), torch.tensor([2, 5, 3, 4, 2, 5])
    with torch.no_grad():
        short = model.logits(SplitForward(model, group=4)(features, tokens, anchors, lengths))
        full = model.logits(SplitForward(model, group=4)(features, tokens, anchors))
    for row, (anchor, length) in enumerate(zip(anchors.tolist(), lengths.tolist())):
        draft.crop(0)
        draft.add_context(features[:anchor])
        torch.testing.assert_close(short[row, :length - 1], draft.propose(int(tokens[anchor]), size=length),
                                   rtol=1e-4, atol=1e-4)
        if length < 5:  # the rows it cut were in the full block's attention: position 1 differs
            assert not torch.allclose(short[row, 0], full[row, 0], rtol=1e-4, atol=1e-4)
    labels = block_labels(tokens, anchors, 5, None, lengths)
    assert ((labels != -100).sum(1) == torch.minimum(lengths - 1, 30 - 1 - anchors)).all()
    assert block_lengths(random.Random(0), 8, 5, 0.0) is None
    drawn = block_lengths(random.Random(0), 4000, 8, 0.5)
    assert set(drawn.tolist()) == set(range(2, 9)) and 0.45 < (drawn == 8).float().mean() < 0.55


def test_split_forward_gradients_match_the_dense_forward(tiny_llama):
    raw, target, model = trained_like(tiny_llama)
    tokens, features, anchors = torch.randint(0, 64, (24,)), torch.randn(24, 2 * 64), torch.tensor([4, 9, 15, 20])
    grads = []
    for forward in (SplitForward(model, group=2), model):
        for p in model.parameters():
            p.grad = None
        (forward(features, tokens, anchors) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_chunked_cross_entropy_is_the_weighted_cross_entropy():
    """Value and gradient equal the plain weighted cross-entropy over full logits, ignored rows included."""
    from hetero_sd.train.loss import chunked_cross_entropy
    torch.manual_seed(0)
    hidden = torch.randn(37, 8, requires_grad=True)
    head = torch.randn(23, 8)
    labels = torch.randint(0, 23, (37,))
    labels[[3, 20]] = -100
    weights = torch.rand(37)
    fast = chunked_cross_entropy(hidden, head, labels, weights, chunk=10)
    (g_fast,) = torch.autograd.grad(fast * 2.0, hidden)
    ce = torch.nn.functional.cross_entropy(hidden @ head.t(), labels, reduction="none", ignore_index=-100)
    plain = (ce * weights).sum()
    (g_plain,) = torch.autograd.grad(plain * 2.0, hidden)
    torch.testing.assert_close(fast, plain)
    torch.testing.assert_close(g_fast, g_plain)
    with pytest.raises(ValueError, match="frozen"):
        chunked_cross_entropy(hidden, head.requires_grad_(), labels, weights)


def test_feature_store_round_trip_resume_and_refusal(tmp_path, tiny_llama):
    """Features come back as stored (bf16), a fill resumes where it stopped, another writer's shards are
    seen, changed tokens miss, and a store of other layers is refused by name."""
    from hetero_sd.errors import ConfigError
    from hetero_sd.train.features import FeatureStore, fill
    rows = [{"key": f"k{i}", "prompt_ids": [1, 2, 3], "response_ids": list(range(4, 4 + i))} for i in range(1, 6)]
    calls = []

    def compute(ids):
        calls.append(len(ids))
        return torch.arange(len(ids) * 4, dtype=torch.float32).view(len(ids), 4) / 7

    store = FeatureStore.for_target(tmp_path / "f", tiny_llama, [0, 1], 4)
    first = fill(store, rows[:3], compute, progress=tmp_path / "f" / "progress.json", log=lambda _: None)
    assert first["done"] == 3 and first["final"]
    other = FeatureStore.for_target(tmp_path / "f", tiny_llama, [0, 1], 4)  # a second process
    again = fill(other, rows, compute, log=lambda _: None)
    assert again["stored_at_start"] == 3 and again["done"] == 2 and len(calls) == 5
    store.refresh()
    for row in rows:
        ids = row["prompt_ids"] + row["response_ids"]
        got = store.get(row["key"], ids)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, compute(ids).to(torch.bfloat16))
    assert store.get("k1", [9, 9, 9, 9]) is None  # same key, other tokens: not these features
    with pytest.raises(ConfigError, match="layer_ids"):
        FeatureStore.for_target(tmp_path / "f", tiny_llama, [0, 2], 4)
    # the int8 target's features never go into a float32 store, nor float32 ones into an int8 store
    with pytest.raises(ConfigError, match="numerics"):
        FeatureStore.for_target(tmp_path / "f", tiny_llama, [0, 1], 4, "int8")
    FeatureStore.for_target(tmp_path / "i", tiny_llama, [0, 1], 4, "int8")
    with pytest.raises(ConfigError, match="features of the int8 target"):
        FeatureStore.for_target(tmp_path / "i", tiny_llama, [0, 1], 4)


def test_a_crafted_checkpoint_is_refused_not_run(tmp_path, tiny_llama):
    """--resume reads checkpoint.pt with weights_only=True: a pickle that would call a function on load is
    refused with a one-line error, and the function never runs."""
    from hetero_sd.errors import ConfigError
    from hetero_sd.train.trainer import TrainConfig, train
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (marker.write_text, ("pwned",))

    out = tmp_path / "d"
    out.mkdir()
    with (out / "checkpoint.pt").open("wb") as f:
        pickle.dump({"model": Payload()}, f)
    rows = [{"index": i, "prompt_ids": [5, 6, 7], "response_ids": list(range(8, 30))} for i in range(8)]
    cfg = TrainConfig(block_size=4, layers=1, steps=2, accumulate=1, held_out=2, eval_every=1)
    with pytest.raises(ConfigError, match="checkpoint.pt: not a checkpoint"):
        train(tiny_llama, rows, out, cfg, resume=True)
    assert not marker.exists()


def test_every_anchor_and_the_schedule(tmp_path, tiny_llama):
    """anchors=0 trains every response token with a successor; the learning rate follows the warm-up +
    cosine multiplier through LambdaLR, and a resumed run continues it from its step."""
    from hetero_sd.train.trainer import TrainConfig, lr_factor, sample_anchors, train
    import random
    assert sample_anchors(random.Random(0), 3, 10, 0).tolist() == [3, 4, 5, 6, 7, 8]
    rows = [{"index": i, "prompt_ids": [5, 6, 7], "response_ids": list(range(8, 20))} for i in range(8)]
    cfg = dict(block_size=4, layers=1, steps=6, warmup=2, accumulate=2, held_out=2, eval_every=3, lr=1e-3)
    logged = []
    train(tiny_llama, rows, tmp_path / "a", TrainConfig(**cfg), progress=logged.append)
    assert [r["blocks"] for r in logged] == [2 * 11] * 6
    assert [r["lr"] for r in logged] == pytest.approx([1e-3 * lr_factor(s, TrainConfig(**cfg)) for s in range(6)])
    resumed = []
    train(tiny_llama, rows, tmp_path / "a", TrainConfig(**{**cfg, "steps": 9}), resume=True, progress=resumed.append)
    assert resumed[0]["step"] == 7
    assert [r["lr"] for r in resumed] == pytest.approx([1e-3 * lr_factor(s, TrainConfig(**{**cfg, "steps": 9}))
                                                        for s in range(6, 9)])
    short = []  # short blocks train the same anchors (their loss over fewer positions)
    train(tiny_llama, rows, tmp_path / "s", TrainConfig(**cfg, short_blocks=0.5), progress=short.append)
    assert [r["blocks"] for r in short] == [2 * 11] * 6 and all(r["loss"] > 0 for r in short)
    assert [r["loss"] for r in short] != [r["loss"] for r in logged]
    assert DraftConfig.from_folder(tmp_path / "s").format.short_blocks  # the runtime drafts it short
    assert not DraftConfig.from_folder(tmp_path / "a").format.short_blocks


def test_replayed_decoding_and_the_ngram_floor():
    """Replay accepts leading matches and re-anchors one past them (the bonus token), as decoding does; a
    bigram rule in the training answers gives the n-gram draft full blocks on held-out rows."""
    from hetero_sd.train.evaluate import NGramDraft, ngram_tau, replay
    ids = list(range(100, 120))
    assert replay(ids, 2, 4, lambda a: ids[a + 1:a + 4], 100) == [4, 4, 4, 4, 1]  # 17 answer tokens after ids[2]
    assert replay(ids, 2, 4, lambda a: [0, 0, 0], 6) == [1] * 5
    assert replay(ids, 2, 4, lambda a: [ids[a + 1], 0, 0], 100) == [2] * 8 + [1]
    train = [{"prompt_ids": [1, 2], "response_ids": list(range(s, s + 12)), "source": "code"} for s in range(3, 40)]
    table = NGramDraft(train)
    held = [{"prompt_ids": [1, 2], "response_ids": list(range(10, 30)), "source": "code"}]
    got = ngram_tau(table, held, 4, 64)
    assert got["code"]["rows"] == 1 and got["all"]["tau"] > 3.5


def test_frequent_vocabulary_holds_every_label_of_the_step():
    """--vocab-frequent K: the K most frequent answer tokens, the step's labels (rare ones too) and the
    negatives; the reduced logits are the full head's columns and every label maps into them."""
    import random
    from hetero_sd.train.model import TrainingVocab
    head = torch.randn(60, 8)
    rows = [{"response_ids": [5] * 9 + [6] * 5 + [7] * 3 + [40, 41]}]
    vocab = TrainingVocab(rows, head, negatives=3, frequent=2)
    assert vocab.answers == [5, 6]
    labels = torch.tensor([[41, 5, -100], [7, 6, 6]])
    vocab.draw(random.Random(0), labels)
    assert {5, 6, 7, 41} <= set(vocab.ids.tolist()) and 40 not in vocab.answers
    mapped = vocab.labels(labels)
    assert torch.equal(torch.where(mapped >= 0, vocab.ids[mapped.clamp_min(0)], -100), labels)
    assert len(vocab) <= 2 + 2 + 3


def test_cache_features_command_fills_the_store_the_trainer_reads(tmp_path, tiny_llama):
    """`train-draft --cache-features` stores every row's features; training with the same --feature-cache
    then runs the target for no sequence, and trains as it does with features computed on the fly."""
    import argparse
    from hetero_sd.train.command import cache_features
    from hetero_sd.train.trainer import TrainConfig, train
    rows = [{"index": i, "key": f"k{i}", "prompt_ids": [5, 6, 7], "response_ids": list(range(8 + i, 24 + i))}
            for i in range(6)]
    store = tmp_path / "features"
    cache_features(tiny_llama, rows, argparse.Namespace(layers=1, device="cpu", feature_cache=str(store),
                                                        feature_numerics="float32", init_from=None))
    assert json.loads((store / "progress.json").read_text())["done"] == 6
    cfg = dict(block_size=4, layers=1, steps=2, accumulate=2, held_out=2, eval_every=2, anchors=4)
    logged = []
    cached = train(tiny_llama, rows, tmp_path / "a", TrainConfig(**cfg, feature_cache=str(store)), progress=logged.append)
    fresh = train(tiny_llama, rows, tmp_path / "b", TrainConfig(**cfg))
    assert logged[-1]["features_computed"] == 0
    assert [r["loss"] for r in cached["history"]] == pytest.approx([r["loss"] for r in fresh["history"]])


def test_packed_sequences_in_the_split_forward_are_each_computed_alone(tiny_llama):
    """--pack with the split attention (what makes a GPU step more than one sequence): three sequences end to
    end, blocks of all lengths, groups that straddle sequence boundaries; every block's hidden state is the
    one its sequence gives alone (its own positions from 0, its own context keys only)."""
    raw, target, model = trained_like(tiny_llama)
    split = SplitForward(model, group=3)
    lengths = (30, 9, 22)
    tokens = [torch.randint(0, 64, (n,)) for n in lengths]
    features = [torch.randn(n, 2 * 64) for n in lengths]
    anchors = [torch.tensor([20, 3, 12, 28]), torch.tensor([1, 7]), torch.tensor([15, 2, 9, 19])]
    short = [torch.tensor([5, 2, 3, 5]), torch.tensor([4, 5]), torch.tensor([2, 5, 5, 3])]
    offsets = [0, 30, 39]
    with torch.no_grad():
        alone = torch.cat([split(f, t, a, s) for f, t, a, s in zip(features, tokens, anchors, short)])
        packed = split(torch.cat(features), torch.cat(tokens), torch.cat([a + o for a, o in zip(anchors, offsets)]),
                       torch.cat(short), torch.cat([torch.full_like(a, o) for a, o in zip(anchors, offsets)]))
        leaky = split(torch.cat(features), torch.cat(tokens), torch.cat([a + o for a, o in zip(anchors, offsets)]),
                      torch.cat(short))
        one_group = SplitForward(model, group=1000)(  # a GPU's large group: one span over all three sequences
            torch.cat(features), torch.cat(tokens), torch.cat([a + o for a, o in zip(anchors, offsets)]),
            torch.cat(short), torch.cat([torch.full_like(a, o) for a, o in zip(anchors, offsets)]))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one_group, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[4:], alone[4:], atol=1e-3)  # without starts the later sequences see the first
