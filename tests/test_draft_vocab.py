"""A reduced draft vocabulary (hetero_sd/models/draft_vocab.py): the draft's head scores only K target ids.
Output stays the target's (greedy: token-identical; T > 0: the target's distribution, chi-square), the
draft never proposes outside its K ids, bad files are refused by name, and every backend applies it
(torch, MLX, ane-sim / Core ML graph) or the policy turns it off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.cli import main
from hetero_sd.decoding.sampling import Sampler, SamplingParams, draft_tokens
from hetero_sd.errors import ConfigError, WeightsError
from hetero_sd.models import draft_vocab
from hetero_sd.models.config import ArchConfig, read_json
from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft

from . import reference_dflash as ref
from .conftest import make_tiny_target
from .test_sampling import PROMPT as SAMPLING_PROMPT, P_MIN, VOCAB, chi_square_p, exact_joint

PROMPT = [5, 9, 12, 7, 30]


def reduced(src: Path, dst: Path, ids, size=None, tensor_ids=None) -> Path:
    """A copy of a draft folder with a draft_vocab; size / tensor_ids override what is written (bad files)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    if size is not None or ids is not None:
        raw.setdefault("dflash_config", {})[draft_vocab.KEY] = size if size is not None else len(ids)
    (dst / "config.json").write_text(json.dumps(raw))
    t = load_file(str(dst / "model.safetensors"))
    written = tensor_ids if tensor_ids is not None else (None if ids is None else torch.tensor(ids))
    if written is not None:
        t[draft_vocab.TENSOR] = written
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def keep_ids(vocab: int, k: int, seed: int = 0) -> list[int]:
    return sorted(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:k].tolist())


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_llama, tiny_draft):
    """tiny_llama (64 tokens) and its random draft reduced to 24 ids that include the target's greedy answer,
    so that some proposals are accepted."""
    base = hetero_sd.load(str(tiny_llama), None).generate(PROMPT, max_new_tokens=30).token_ids
    ids = sorted(set(base) | set(keep_ids(64, 24)))[:40]
    return tiny_llama, reduced(tiny_draft, tmp_path_factory.mktemp("d") / "reduced", ids), ids


def test_greedy_with_a_reduced_head_is_the_target_alone(small):
    target, folder, ids = small
    rt = hetero_sd.load(str(target), str(folder), block_size="fixed")
    assert rt.info["draft_head"] == f"{len(ids)} of 64 rows"
    assert any(n.startswith(f"draft head: {len(ids)} of 64 rows") for n in rt.info["notes"])
    assert rt.info["draft_format"] == f"dflash; draft head {len(ids)} rows"
    base = rt.generate(PROMPT, max_new_tokens=30, speculative=False).token_ids
    for kw in ({}, dict(block="auto"), dict(block=3), dict(schedule="overlap")):
        assert rt.generate(PROMPT, max_new_tokens=30, **kw).token_ids == base, kw
    assert [g.token_ids for g in rt.generate_many([PROMPT, [3, 4, 5]], max_new_tokens=12)][0] == base[:12]


def test_proposals_stay_inside_the_k_ids(small):
    target, folder, ids = small
    rt = hetero_sd.load(str(target), str(folder), block_size="fixed", draft_dtype="float32")
    rt.draft.add_context(torch.randn(9, rt.draft.fc.shape[0]) * 3)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    for anchor in range(0, 64, 7):
        logits = rt.draft.propose(anchor)
        assert logits.shape == (5, 64) and torch.isfinite(logits).all()  # finite: the loop's fault check passes
        assert (logits[:, outside] == draft_vocab.FLOOR).all() and (logits[:, ~outside] > -1e4).all()
        for seed, params in enumerate([SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.3, top_k=40)]):
            tokens, q = draft_tokens(Sampler(params, seed).at(0), logits, "rejection")
            assert set(tokens) <= set(ids)
            if q is not None:  # q: the distribution the tokens were drawn from, exactly 0 outside the ids
                assert (q[:, outside] == 0).all() and torch.allclose(q.sum(-1), torch.ones(5))


def test_the_reduced_head_is_the_full_head_at_those_rows(small):
    """The K scores equal the full draft's logits at the same ids (same layers, the head's rows sliced)."""
    target, folder, ids = small
    full = hetero_sd.load(str(target), str(folder), draft_dtype="float32", policy=LoadPolicy(draft_vocab=False))
    part = hetero_sd.load(str(target), str(folder), draft_dtype="float32")
    assert full.info["draft_head"] == "64 of 64 rows" and any("every row" in n for n in full.info["notes"])
    assert full.info["cost_key"] != part.info["cost_key"]  # the costs of one are not the other's
    features = full.target.forward(PROMPT).features
    for rt in (full, part):
        rt.draft.add_context(features)
    a, b = full.draft.propose(11), part.draft.propose(11)
    torch.testing.assert_close(b[:, ids], a[:, ids], rtol=1e-5, atol=1e-5)


# --- temperature > 0: the target's distribution, exactly ------------------------------------------------

@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """test_sampling's 8-token target with a draft reduced to 5 of its 8 tokens."""
    target = make_tiny_target(tmp_path_factory.mktemp("t8"), "llama", vocab_size=VOCAB, seed=3,
                              initializer_range=0.35)
    raw = draft_config(ArchConfig.from_dict(read_json(target / "config.json")), num_layers=1, block_size=4,
                       mask_token_id=3, layer_ids=[1, 3])
    draft = write_draft(tmp_path_factory.mktemp("d8"), raw, random_draft_tensors(raw, seed=1, std=0.3),
                        dtype=torch.float32)
    return target, reduced(draft, tmp_path_factory.mktemp("d8r") / "r", [0, 2, 4, 5, 7])


def test_samples_follow_the_target_distribution(sampling_pair):
    """End to end at T=1 with the rejection rule: the first two tokens of 800 seeded generations against
    the target's exact joint (enumerated with transformers' model), pooled as in test_sampling."""
    from collections import Counter

    target, folder = sampling_pair
    rt = hetero_sd.load(str(target), str(folder), block_size="fixed")
    assert rt.info["draft_head"] == "5 of 8 rows"
    params, totals, samples = SamplingParams(1.0), Counter(), []
    for seed in range(800):
        g = rt.generate(SAMPLING_PROMPT, max_new_tokens=2, temperature=1.0, seed=seed, rule="rejection")
        samples.append(tuple(g.token_ids[:2]))
        totals.update(accepted=g.stats.num_accepted_tokens, drafted=g.stats.num_draft_tokens)
    joint = Counter()
    for outcome, prob in exact_joint(target, params).items():
        joint[outcome[:2]] += prob
    p = chi_square_p(samples, dict(joint))
    assert p > P_MIN, f"samples do not follow the target distribution (chi-square p = {p:.2e})"
    assert 0 < totals["accepted"] < totals["drafted"]  # both branches of the rule were exercised
    assert {t for s in samples for t in s} - {0, 2, 4, 5, 7}  # the target still emits what the draft cannot


# --- bad files are refused with the problem and the fix -----------------------------------------------

BAD = {
    "tensor-without-key": (dict(ids=None, tensor_ids=torch.tensor([1, 2, 3])), WeightsError, "no draft_vocab_size"),
    "key-without-tensor": (dict(ids=None, size=3), WeightsError, "no draft_vocab tensor"),
    "out-of-range": (dict(ids=[1, 2, 99]), WeightsError, "holds id 99 outside"),
    "negative": (dict(ids=[-1, 2, 3]), WeightsError, "holds id -1 outside"),
    "duplicate": (dict(ids=[4, 7, 4]), WeightsError, "holds id 4 more than once"),
    "float-ids": (dict(ids=[1, 2], tensor_ids=torch.tensor([1.0, 2.0])), WeightsError, "not integer ids"),
    "length": (dict(ids=[1, 2], size=3), WeightsError, "has shape (2,), config says [3]"),
    "size-zero": (dict(ids=[1], size=0), ConfigError, "draft_vocab_size 0 is not an integer in 1..64"),
    "size-too-large": (dict(ids=[1], size=65), ConfigError, "draft_vocab_size 65 is not an integer in 1..64"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_files_are_refused_by_name(case, tiny_llama, tiny_draft, tmp_path):
    kw, error, words = BAD[case]
    folder = reduced(tiny_draft, tmp_path / case, **kw)
    with pytest.raises(error) as e:
        hetero_sd.load(str(tiny_llama), str(folder))
    assert words in e.value.problem and "\n" not in str(e.value)
    assert "draft-vocab" in e.value.fix or "draft_vocab_size" in e.value.fix


def test_the_cli_says_it_in_one_error_line(tiny_llama, tiny_draft, tmp_path, capsys):
    folder = reduced(tiny_draft, tmp_path / "dup", [4, 7, 4])
    assert main(["generate", "t5 t6", "--target", str(tiny_llama), "--draft", str(folder),
                 "--max-new-tokens", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error:" in err and "more than once" in err and "fix:" in err


def test_a_draft_without_the_key_loads_unchanged(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft))
    assert rt.info["draft_head"] == "64 of 64 rows" and rt.draft.head.ids is None
    assert rt.info["draft_format"] == "dflash"


# --- every backend applies it --------------------------------------------------------------------------

def test_ane_sim_and_the_core_ml_graph_score_only_the_k_rows(small):
    from hetero_sd.ane_compiler.graph import SafeDraftGraph

    target, folder, ids = small
    rt = hetero_sd.load(str(target), str(folder), draft_device="ane-sim", block_size="fixed")
    reference = rt.draft.reference
    graph = SafeDraftGraph(reference)
    assert graph.w.lm_head.shape[0] == len(ids)  # the package's head is the K rows: [K, hidden, 1, 1]
    base = rt.generate(PROMPT, max_new_tokens=20, speculative=False).token_ids
    spec = rt.generate(PROMPT, max_new_tokens=20)
    assert spec.token_ids == base
    drift = spec.stats.to_dict()["drift"]
    assert drift["blocks"] == spec.stats.num_drafts > 0 and np.isfinite(drift["kl"]) and drift["cosine"] > 0.999
    rt.draft.crop(0)
    rt.draft.add_context(rt.target.forward([5, 6, 7]).features)
    logits = rt.draft.inner.propose(9)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert logits.shape == (5, 64) and (logits[:, outside] == draft_vocab.FLOOR).all()


def test_mlx_applies_the_reduced_head(small):
    pytest.importorskip("mlx.core")
    target, folder, ids = small
    torch_rt = hetero_sd.load(str(target), str(folder), draft_dtype="float32", block_size="fixed")
    mlx_rt = hetero_sd.load(str(target), str(folder), draft_device="mlx", block_size="fixed")
    features = torch_rt.target.forward(PROMPT).features
    for rt in (torch_rt, mlx_rt):
        rt.draft.add_context(features)
    a, b = torch_rt.draft.propose(11), mlx_rt.draft.propose(11)
    assert b.shape == (5, 64)
    torch.testing.assert_close(b[:, ids], a[:, ids], rtol=1e-4, atol=1e-4)
    assert (b.argmax(-1)[:, None] == torch.tensor(ids)[None]).any(-1).all()
    base = mlx_rt.generate(PROMPT, max_new_tokens=16, speculative=False).token_ids
    assert mlx_rt.generate(PROMPT, max_new_tokens=16).token_ids == base


def test_dflash2_works_with_a_reduced_head(tmp_path):
    """The selector picks among each position's top-k of the widened logits: inside the K ids."""
    target = make_tiny_target(tmp_path / "t12", "qwen3", vocab_size=12, seed=2, tie_word_embeddings=True)
    ref.make_reference_draft(tmp_path / "d2", dflash2=True, vocab=12)
    ids = [0, 2, 3, 5, 6, 8, 9, 11]
    folder = reduced(tmp_path / "d2", tmp_path / "d2r", ids)
    rt = hetero_sd.load(str(target), str(folder), block_size="fixed")
    prompt = [5, 9, 7, 2, 4, 6]
    assert rt.generate(prompt, max_new_tokens=24).token_ids == rt.generate(prompt, max_new_tokens=24,
                                                                           speculative=False).token_ids
    rt.draft.add_context(rt.target.forward(prompt).features)
    block = rt.draft.propose(4)
    for params in (SamplingParams(0.0), SamplingParams(1.0)):
        tokens, q = block.choose(Sampler(params, 3), "rejection")
        assert set(tokens) <= set(ids)
        assert q is None or q[:, [1, 4, 7, 10]].sum() == 0


# --- hetero-sd draft-vocab ----------------------------------------------------------------------------

def fake_shards(folder: Path, answers: dict[str, list[int]], vocab: int = 64) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "vocab_size": vocab, "stop_ids": [1]}))
    keys = list(answers)
    lengths = [len(answers[k]) for k in keys]
    np.savez_compressed(folder / "shard-00000.npz", keys=np.array(keys),
                        prompt_len=np.zeros(len(keys), np.int32), prompt_crc=np.zeros(len(keys), np.uint32),
                        finished=np.ones(len(keys), bool), offsets=np.concatenate([[0], np.cumsum(lengths)]),
                        tokens=np.array([t for k in keys for t in answers[k]], np.uint16))
    return folder


def test_draft_vocab_command_keeps_the_most_frequent_training_tokens(tiny_llama, tiny_draft, tmp_path):
    import zlib

    answers = {f"k{i}": [10] * 5 + [20] * 4 + [30] * 3 + [40 + i % 3] for i in range(12)}
    held = sorted(answers, key=lambda k: zlib.crc32(k.encode()))[0]
    answers[held] = [50] * 100  # the held-out row's tokens must not be counted
    shards = fake_shards(tmp_path / "shards", answers)
    out = tmp_path / "reduced"
    assert main(["draft-vocab", "--draft", str(tiny_draft), "--k", "4", "--out", str(out), "--distill", str(shards),
                 "--held-out", "1"]) == 0
    report = json.loads((out / "draft_vocab.json").read_text())
    # z-lab's two files as the source draft's; the head's ids beside them (models/draft_format.py)
    assert json.loads((out / "hetero_sd.json").read_text())["draft_vocab"] == [1, 10, 20, 30]  # + the stop id
    assert report["k"] == 4 and report["coverage_held_out_answers"] == 0.0
    assert json.loads((out / "config.json").read_text()) == json.loads((tiny_draft / "config.json").read_text())
    assert load_file(str(out / "model.safetensors")).keys() == load_file(str(tiny_draft / "model.safetensors")).keys()
    rt = hetero_sd.load(str(tiny_llama), str(out))
    assert rt.info["draft_head"] == "4 of 64 rows"
    assert main(["draft-vocab", "--draft", str(tiny_draft), "--k", "4", "--out", str(out),
                 "--distill", str(shards)]) == 2  # an existing folder is not overwritten
    assert main(["draft-vocab", "--draft", str(tiny_draft), "--k", "0", "--out", str(tmp_path / "x"),
                 "--distill", str(shards)]) == 2


def test_rejection_with_a_floor_widened_q_keeps_the_target_distribution():
    """The rule alone (no model, fast): proposals from logits widened with FLOOR (q is 0 outside the K ids,
    as the runtime's reduced draft gives them), position-keyed randomness, a loop that re-drafts after a
    rejection. The first two emitted tokens follow p0 x p1, including tokens the draft can never propose
    (chi-square over 3000 seeds), and the draft's proposals are always inside its ids."""
    from collections import Counter

    from scipy.stats import chisquare

    from hetero_sd.decoding.sampling import rejection

    g = torch.Generator().manual_seed(1)
    vocab, ids = 5, torch.tensor([0, 2, 3])
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 1.2, -1)  # the target at positions 0, 1, 2
    scores = torch.randn(3, len(ids), generator=g) * 1.5  # the reduced draft's K scores there
    logits = draft_vocab.expand(scores, ids, vocab)
    counts, proposed, n = Counter(), set(), 3000
    for seed in range(n):
        sampler, out = Sampler(SamplingParams(1.0), seed), []
        while len(out) < 2:
            at = len(out)
            sampler.at(at)
            drafted, q = draft_tokens(sampler, logits[at:2], "rejection")
            proposed.update(drafted)
            out += rejection(sampler, p[at:at + len(drafted) + 1], drafted, q).tokens
        counts[tuple(out[:2])] += 1
    assert proposed <= set(ids.tolist()) and {t for pair in counts for t in pair} - set(ids.tolist())
    joint = (p[0][:, None] * p[1][None, :]).double().numpy().ravel()
    observed = np.array([counts[(i, j)] for i in range(vocab) for j in range(vocab)], dtype=float)
    assert chisquare(observed, joint / joint.sum() * observed.sum()).pvalue > 1e-3
