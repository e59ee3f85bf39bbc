"""The draft trainer: its forward is the inference forward, it learns, it resumes exactly."""

from __future__ import annotations

import random

import pytest
import torch

import hetero_sd
from hetero_sd.backends.torch_backend import load_draft, load_target
from hetero_sd.models.config import ArchConfig, DraftConfig, read_json
from hetero_sd.models.draft_init import draft_config, write_draft
from hetero_sd.train.model import TrainingDraft, TrainingVocab
from hetero_sd.train.trainer import (FeatureCache, TrainConfig, block_labels, init_from_target, soft_ce,
                                     split_held_out, train)
from hetero_sd.models.weights import load_weights
from hetero_sd.errors import ConfigError


def test_training_forward_is_the_inference_forward(tmp_path, tiny_llama):
    tcfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(tcfg, num_layers=2, block_size=5, mask_token_id=3, layer_ids=[0, 1])
    target = load_target(tiny_llama, tcfg, "cpu", torch.float32, [0, 1])
    model = TrainingDraft(raw, target.embed, target.lm_head.t())
    init_from_target(model, load_weights(tiny_llama), tcfg.num_hidden_layers)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # leave the exact copy so every tensor matters
    folder = write_draft(tmp_path / "d", raw, dict(model.state_dict()), dtype=torch.float32)
    draft = load_draft(folder, DraftConfig.from_folder(folder), target, "cpu", torch.float32, 3)
    tokens = torch.randint(0, 64, (30,))
    features = torch.randn(30, 2 * 64)
    with torch.no_grad():
        trained = model.logits(model(features, tokens, torch.tensor([12, 20])))
    for row, anchor in enumerate([12, 20]):
        draft.crop(0)
        draft.add_context(features[:anchor])
        torch.testing.assert_close(trained[row], draft.propose(int(tokens[anchor])), rtol=1e-4, atol=1e-4)


def test_packed_sequences_train_as_if_each_ran_alone(tiny_llama):
    """Two sequences packed end to end in one forward give each block exactly the hidden states it gets
    from its own sequence alone: the mask keeps a block out of the other sequence's context."""
    tcfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(tcfg, num_layers=2, block_size=5, mask_token_id=3, layer_ids=[0, 1])
    target = load_target(tiny_llama, tcfg, "cpu", torch.float32, [0, 1])
    model = TrainingDraft(raw, target.embed, target.lm_head.t())
    lengths, anchors = (30, 22), (torch.tensor([12, 20]), torch.tensor([3, 9, 17]))
    tokens = [torch.randint(0, 64, (n,)) for n in lengths]
    features = [torch.randn(n, 2 * 64) for n in lengths]
    with torch.no_grad():
        alone = torch.cat([model(f, t, a) for f, t, a in zip(features, tokens, anchors)])
        packed = model(torch.cat(features), torch.cat(tokens), torch.cat([anchors[0], anchors[1] + 30]),
                       torch.tensor([0, 0, 30, 30, 30]))
        leaky = model(torch.cat(features), torch.cat(tokens), torch.cat([anchors[0], anchors[1] + 30]))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[2:], alone[2:], atol=1e-3)  # without starts, the second sequence sees the first
    labels = block_labels(torch.cat(tokens), torch.tensor([27, 50]), 5, torch.tensor([30, 52]))
    assert labels.tolist() == [tokens[0][28:30].tolist() + [-100, -100], [tokens[1][21].item(), -100, -100, -100]]


def test_packed_training_learns_and_the_device_is_checked(tmp_path, tiny_llama):
    rows = counting_rows()
    first = train(tiny_llama, rows, tmp_path / "d", small_config(steps=1, eval_every=1, pack=2))["history"][-1]
    last = train(tiny_llama, rows, tmp_path / "d", small_config(steps=200, lr=1e-2, eval_every=100, pack=2,
                                                                 autocast="bf16"))["history"][-1]
    assert last["held_out_tau"] > first["held_out_tau"] + 0.7, (first, last)
    with pytest.raises(ConfigError, match="--pack 4 with --accumulate 2"):
        train(tiny_llama, rows, tmp_path / "e", small_config(steps=1, pack=4))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no cuda device"):
            train(tiny_llama, rows, tmp_path / "e", small_config(steps=1, device="cuda"))


@pytest.fixture(scope="module")
def self_distilled(tiny_llama):
    """The tiny target's own greedy answers to random prompts (what train/data.py makes for real models)."""
    rt = hetero_sd.load(str(tiny_llama), None)
    rng = random.Random(0)
    rows = []
    for i in range(40):
        prompt = [rng.randrange(4, 64) for _ in range(rng.randrange(3, 8))]
        rows.append({"index": i, "prompt_ids": prompt,
                     "response_ids": rt.generate(prompt, max_new_tokens=40).token_ids})
    return rows


def small_config(**kw) -> TrainConfig:
    base = dict(block_size=4, layers=1, steps=60, lr=3e-3, warmup=5, accumulate=2, anchors=8, held_out=6,
                eval_every=20, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def counting_rows(n: int = 40) -> list[dict]:
    """A learnable rule (each token is the previous one + 1): an off-by-one between anchors, labels and
    the block mask would keep the held-out acceptance at 1."""
    rng = random.Random(1)
    rows = []
    for i in range(n):
        start = rng.randrange(4, 40)
        rows.append({"index": i, "prompt_ids": [rng.randrange(4, 64) for _ in range(4)],
                     "response_ids": list(range(start, start + 20))})
    return rows


def test_training_learns_block_predictions(tmp_path, tiny_llama):
    rows = counting_rows()
    first = train(tiny_llama, rows, tmp_path / "d", small_config(steps=1, eval_every=1))["history"][-1]
    last = train(tiny_llama, rows, tmp_path / "d", small_config(steps=200, lr=1e-2, eval_every=100))["history"][-1]
    assert last["loss"] < first["loss"] * 0.7
    assert last["held_out_tau"] > first["held_out_tau"] + 0.7, (first, last)


def test_trained_draft_loads_and_decodes_losslessly(tmp_path, tiny_llama, self_distilled):
    train(tiny_llama, self_distilled, tmp_path / "draft", small_config(steps=20))
    rt = hetero_sd.load(str(tiny_llama), str(tmp_path / "draft"))
    for row in self_distilled[:3]:
        spec = rt.generate(row["prompt_ids"], max_new_tokens=30)
        assert spec.token_ids == rt.generate(row["prompt_ids"], max_new_tokens=30, speculative=False).token_ids


@pytest.mark.parametrize("prefetch", [False, True])
def test_resume_continues_exactly(tmp_path, tiny_llama, self_distilled, prefetch):
    """Interrupted and resumed, a run trains what it trains straight; with the next step's batches drawn on a
    helper thread (a GPU's default, forced here) too: the same batches, the same weights, bit for bit."""
    cfg = dict(steps=12, eval_every=4)
    straight = train(tiny_llama, self_distilled, tmp_path / "a", small_config(**cfg))
    cfg["prefetch"] = prefetch

    def stop_at_8(record):
        if record["step"] == 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_llama, self_distilled, tmp_path / "b", small_config(**cfg), progress=stop_at_8)
    resumed = train(tiny_llama, self_distilled, tmp_path / "b", small_config(**cfg), resume=True)
    assert [r["loss"] for r in resumed["history"]] == pytest.approx([r["loss"] for r in straight["history"]])
    a, b = load_weights(tmp_path / "a"), load_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_training_vocab_is_a_slice_of_the_full_head():
    """The reduced softmax sees exactly the full logits' columns for the answers' tokens, and the labels
    point at the same tokens; anything else would train the draft towards the wrong tokens."""
    torch.manual_seed(0)
    head = torch.randn(50, 8)
    rows = [{"response_ids": [7, 3, 3, 41]}, {"response_ids": [12, 7]}]
    vocab = TrainingVocab(rows, head, negatives=5)
    assert vocab.ids.tolist() == [3, 7, 12, 41]
    vocab.draw(random.Random(0))
    assert len(vocab) == 9 and {3, 7, 12, 41} < set(vocab.ids.tolist())
    labels = torch.tensor([[41, 3, -100], [12, 7, 7]])
    mapped = vocab.labels(labels)
    assert torch.equal(torch.where(mapped >= 0, vocab.ids[mapped.clamp_min(0)], -100), labels)
    hidden = torch.randn(2, 3, 8)
    full, part = hidden @ head.t(), hidden @ vocab.head.t()
    assert torch.allclose(part, full[..., vocab.ids])


def test_soft_labels_from_a_one_hot_teacher_are_the_hard_labels():
    """The teacher's row for label k of a block is position anchor+k-1 (it predicts token anchor+k): a
    teacher sure of the true next token must give exactly the hard cross-entropy, with or without the
    reduced vocabulary."""
    torch.manual_seed(0)
    block, v, k = 5, 11, 4
    tokens = torch.randint(0, v, (20,))
    anchors = torch.tensor([2, 7, 15])  # the last block runs past the end: those labels are ignored
    labels = block_labels(tokens, anchors, block)
    logq = torch.randn(3, block - 1, v).log_softmax(-1)
    ids = torch.randint(0, v, (20, k))
    ids[:, 0] = torch.roll(tokens, -1)
    logp = torch.full((20, k), -1e4)
    logp[:, 0] = 0.0
    valid = labels >= 0
    hard = -logq.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    soft = soft_ce(logq, (logp, ids), anchors, block, None)
    assert torch.allclose(soft[valid], hard[valid])
    vocab = TrainingVocab([{"response_ids": tokens.tolist()}], torch.randn(v, 8), negatives=0)
    part = logq[..., vocab.ids].log_softmax(-1)
    mapped = vocab.labels(labels)
    assert torch.allclose(soft_ce(part, (logp, ids), anchors, block, vocab)[valid],
                          -part.gather(-1, mapped.clamp_min(0)[..., None])[..., 0][valid])


def test_teacher_rows_are_the_targets_next_token_distributions(tiny_llama, self_distilled):
    """Row p of the teacher is the target's distribution for token p+1: on the target's own greedy
    answers its most likely token is the answer's next token, at every answer position."""
    tcfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    cache = FeatureCache(tiny_llama, [0, 2], top_k=4)
    for row in self_distilled[:5]:
        ids, p = row["prompt_ids"] + row["response_ids"], len(row["prompt_ids"])
        logp, top = cache.teacher(row["index"], ids)
        assert top.shape == (len(ids), 4) and logp.shape == (len(ids), 4)
        assert top[p - 1:-1, 0].tolist() == ids[p:]
        assert cache(row["index"], ids).shape == (len(ids), 2 * tcfg.hidden_size)


def test_training_on_the_targets_soft_labels_lowers_the_loss(tmp_path, tiny_llama, self_distilled):
    cfg = dict(lr=1e-2, soft=1.0, soft_top_k=8)
    first = train(tiny_llama, self_distilled, tmp_path / "d", small_config(steps=1, eval_every=1, **cfg))
    last = train(tiny_llama, self_distilled, tmp_path / "d", small_config(steps=60, eval_every=60, **cfg))
    assert last["history"][-1]["loss"] < first["history"][-1]["loss"] * 0.8


def test_held_out_rows_of_growing_shards_were_never_trained_on():
    """Shards grow between runs; a row in the training part of a smaller data set must never be
    held out from a larger one (its held-out tau would be measured on trained-on data)."""
    rows = [{"index": i, "key": f"sharegpt:c{i}_0#0", "response_ids": [1, 2]} for i in range(400)]
    seen_in_training: set[str] = set()
    for size in (50, 120, 400):
        held, rest = split_held_out(rows[:size], 8, seed=0)
        assert len(held) == 8 and len(rest) == size - 8
        assert not {r["key"] for r in held} & seen_in_training
        seen_in_training |= {r["key"] for r in rest}
    plain = [{"index": i, "response_ids": [1, 2]} for i in range(30)]  # the first recipe's rows: as before
    order = list(range(30))
    random.Random(3).shuffle(order)
    held, rest = split_held_out(plain, 5, 3)
    assert [r["index"] for r in held + rest] == order


def test_each_store_keeps_its_own_held_out_rows():
    """Training on two stores (e.g. the float32 answers and the int8 answers to other prompts): each store's
    held-out rows are the ones it has alone, so the first store's evaluation set never changes and is never
    trained on."""
    first = [{"index": i, "key": f"sharegpt:c{i}_0#0", "response_ids": [1, 2], "store": 0} for i in range(100)]
    second = [{"index": 100 + i, "key": f"sharegpt:d{i}_0#3", "response_ids": [1, 2], "store": 1} for i in range(300)]
    held, rest = split_held_out(first + second, 8, seed=0)
    alone = split_held_out([{k: v for k, v in r.items() if k != "store"} for r in first], 8, seed=0)[0]
    assert [r["key"] for r in held if r["store"] == 0] == [r["key"] for r in alone]
    assert len(held) == 16 and len(rest) == 384 and not {r["key"] for r in held} & {r["key"] for r in rest}


def test_init_from_a_draft_starts_from_its_weights(tmp_path, tiny_llama, self_distilled):
    """--init-from: step 0 of the warm start holds the earlier draft's weights (bf16 as saved), a draft of
    another shape is refused by name, and another block size is not another shape (a block is rows)."""
    train(tiny_llama, self_distilled, tmp_path / "first", small_config(steps=6, eval_every=6))
    warm = train(tiny_llama, self_distilled, tmp_path / "warm", small_config(steps=1, eval_every=1, lr=0.0,
                                                                            init=str(tmp_path / "first")))
    cold = train(tiny_llama, self_distilled, tmp_path / "cold", small_config(steps=1, eval_every=1, lr=0.0))
    a, b = load_weights(tmp_path / "first"), load_weights(tmp_path / "warm")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert warm["history"][-1]["loss"] < cold["history"][-1]["loss"]
    other = train(tiny_llama, self_distilled, tmp_path / "b8", small_config(steps=1, eval_every=1, lr=0.0, block_size=8,
                                                                         init=str(tmp_path / "first")))
    assert all(torch.equal(a[k], v) for k, v in load_weights(tmp_path / "b8").items() if k in a)
    assert other["history"][-1]["step"] == 1


def test_a_deeper_draft_grown_from_a_shallower_one_starts_as_its_function(tmp_path, tiny_llama, self_distilled):
    """--layers above the init draft's: its layers come first, each new one starts as an identity (output
    projections zero), so the grown draft's logits equal the old draft's before a step; its features stay the
    old draft's layers; a shallower --layers than the init draft is refused by name."""
    train(tiny_llama, self_distilled, tmp_path / "first", small_config(steps=6, eval_every=6))
    train(tiny_llama, self_distilled, tmp_path / "grown", small_config(steps=1, eval_every=1, lr=0.0, layers=2,
                                                                       init=str(tmp_path / "first")))
    old_raw, new_raw = read_json(tmp_path / "first" / "config.json"), read_json(tmp_path / "grown" / "config.json")
    assert new_raw["num_hidden_layers"] == 2 and old_raw["num_hidden_layers"] == 1
    assert new_raw["dflash_config"]["target_layer_ids"] == old_raw["dflash_config"]["target_layer_ids"]
    a, b = load_weights(tmp_path / "first"), load_weights(tmp_path / "grown")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not b["layers.1.self_attn.o_proj.weight"].any() and not b["layers.1.mlp.down_proj.weight"].any()
    assert b["layers.1.self_attn.q_proj.weight"].abs().sum() > 0  # a target layer's copy, not zeros
    tcfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    target = load_target(tiny_llama, tcfg, "cpu", torch.float32, old_raw["dflash_config"]["target_layer_ids"])
    logits = []
    for raw, weights in ((old_raw, a), (new_raw, b)):
        model = TrainingDraft(raw, target.embed, target.lm_head.t())
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        torch.manual_seed(0)
        tokens, features = torch.randint(0, 64, (30,)), torch.randn(30, model.fc.weight.shape[1])
        with torch.no_grad():
            logits.append(model.logits(model(features, tokens, torch.tensor([12, 20]))))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    with pytest.raises(hetero_sd.errors.ConfigError, match="num_hidden_layers"):
        train(tiny_llama, self_distilled, tmp_path / "x", small_config(steps=1, layers=1, init=str(tmp_path / "grown")))


def test_gamma_is_passed_down_and_refused_when_not_positive(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "train-draft", "--target", "default", "--out",
                          str(tmp_path), "--gamma", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--gamma 0.0: the loss's position decay must be > 0" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "train-draft", "--target", "default", "--out",
                          str(tmp_path), "--short-blocks", "1.5"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--short-blocks 1.5: a share of the blocks, 0 to 1" in out.stderr
    assert "Traceback" not in out.stderr
    assert small_config(gamma=2.0).decay() == 2.0 and small_config(block_size=16).decay() == 7.0


def test_a_time_budget_ends_training_with_a_save(tmp_path, tiny_llama):
    """--minutes (a time budget): the run stops when the budget is spent, evaluated and saved, before --steps."""
    out = train(tiny_llama, counting_rows(), tmp_path / "d", small_config(steps=10_000, eval_every=5000,
                                                                           minutes=1e-4))
    step = out["history"][-1]["step"]
    assert 1 <= step < 10_000 and "held_out_tau" in out["history"][-1]
    assert (tmp_path / "d" / "model.safetensors").is_file() and (tmp_path / "d" / "checkpoint.pt").is_file()


def test_batched_features_are_the_targets_own_features(tmp_path, tiny_llama):
    """A GPU's feature cache computes a step's new sequences in one padded forward of transformers' model:
    each sequence's features are those our target gives it alone (the layer-3 entry, the last layer's, after
    the final norm as ours), in memory and on disk, and a batch drawn with it is the batch drawn without."""
    from hetero_sd.train.trainer import make_batch
    rows = counting_rows(6)
    for r in rows[::2]:
        r["response_ids"] = r["response_ids"][:7]  # sequences of different lengths: padding at work
    layers = [0, 2, 3]
    for disk in (None, tmp_path / "store"):
        plain, batched = FeatureCache(tiny_llama, layers), FeatureCache(tiny_llama, layers, batched=True, disk=disk)
        forwards = []
        batched.batched.register_forward_hook(lambda *a: forwards.append(1))
        a = make_batch(rows, 4, random.Random(5), 3, plain, False, "cpu")
        b = make_batch(rows, 4, random.Random(5), 3, batched, False, "cpu")
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.anchors, b.anchors)
        torch.testing.assert_close(b.features, a.features, rtol=1e-2, atol=1e-2)  # both stored as bf16
        assert len(forwards) == 1 and batched.computed == plain.computed > 1  # every new row in one forward
    assert FeatureCache(tiny_llama, layers, batched=True, top_k=4).batched is None  # soft labels: our target
