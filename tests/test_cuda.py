"""CUDA paths: lossless decoding with the target and/or the draft on a CUDA device, and training there.
Skipped where torch sees no CUDA device (CI); run on a GPU machine by `python3 benchmarks/gpu_check.py --tests`.

The target runs in float32 here: a CUDA target defaults to bf16, whose GEMMs are not batch-invariant (a
block's verify and one-row decoding may round a near-tie apart), so token identity is the float32 promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hetero_sd

from hetero_sd.decoding.sampling import SamplingParams

from .test_sampling import P_MIN, chi_square_p, exact_joint, pair, sample_many  # noqa: F401 (pair: a fixture)
from .test_train import counting_rows, small_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 12, 7], [33, 2, 40, 41, 8, 19], [60, 61]]
MAX_NEW = 48
F32 = torch.float32


@pytest.fixture(scope="module")
def cuda_baseline(tiny_llama):
    """The CUDA target's own greedy tokens: every placement with the target on CUDA must give them."""
    rt = hetero_sd.load(str(tiny_llama), None, target_device="cuda", dtype=F32)
    return [rt.generate(p, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids for p in PROMPTS]


@pytest.mark.parametrize("draft_device,schedule", [("cuda", "sequential"), ("cpu", "sequential"),
                                                    ("cpu", "overlap")])
def test_target_on_cuda_is_lossless(tiny_llama, tiny_draft, cuda_baseline, draft_device, schedule):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), target_device="cuda", draft_device=draft_device,
                        block_size="fixed", schedule=schedule, dtype=F32)
    for prompt, base in zip(PROMPTS, cuda_baseline):
        out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
        assert out.stats.mode == "speculative" and out.stats.num_drafts > 0, (out.stats.fallback, out.stats.notes)
        assert out.token_ids == base
    placed = torch.device(rt.info["target_device"]).type, torch.device(rt.info["draft_device"]).type
    assert placed == ("cuda", draft_device)  # the info names the device as placed ("cuda:0")


def test_draft_on_cuda_beside_a_cpu_target_is_lossless(tiny_llama, tiny_draft):
    plain = hetero_sd.load(str(tiny_llama), None)
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), draft_device="cuda", block_size="fixed")
    for prompt in PROMPTS:
        base = plain.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids
        out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
        assert out.stats.num_drafts > 0 and out.token_ids == base, (out.stats.fallback, out.stats.notes)


def test_bf16_draft_on_cuda_is_lossless(tiny_llama, tiny_draft, cuda_baseline):
    """A bf16 draft drafts differently, never decides: the output stays the target's."""
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), target_device="cuda", draft_device="cuda",
                        draft_dtype=torch.bfloat16, block_size="fixed", dtype=F32)
    for prompt, base in zip(PROMPTS, cuda_baseline):
        out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
        assert out.stats.num_drafts > 0 and out.token_ids == base, (out.stats.fallback, out.stats.notes)


@pytest.mark.timeout(150)  # 2500 seeded generations: 46 s on an H200 machine, over the script's 40 s
@pytest.mark.parametrize("rule", ["rejection"])
def test_sampling_on_cuda_follows_the_target_distribution(pair, rule):
    """T=1 with the target and the draft on CUDA: the first three tokens follow the target's exact joint
    distribution (test_sampling's enumeration and chi-square, 2500 seeds)."""
    rt = hetero_sd.load(str(pair[0]), str(pair[1]), target_device="cuda", draft_device="cuda", block_size="fixed",
                        dtype=F32)
    params = SamplingParams(1.0)
    samples, totals = sample_many(rt, params, rule=rule)
    p = chi_square_p(samples, exact_joint(pair[0], params))
    assert p > P_MIN, f"CUDA samples do not follow the target distribution (chi-square p = {p:.2e})"
    assert 0 < totals["accepted"] < totals["drafted"]


def test_training_on_cuda_learns(tmp_path, tiny_llama):
    from hetero_sd.train.trainer import train
    rows = counting_rows()
    first = train(tiny_llama, rows, tmp_path / "d", small_config(steps=1, eval_every=1, device="cuda"))
    last = train(tiny_llama, rows, tmp_path / "d", small_config(steps=200, lr=1e-2, eval_every=100, device="cuda"))
    assert "bf16 autocast" in last["notes"]["autocast"]
    assert last["history"][-1]["held_out_tau"] > first["history"][-1]["held_out_tau"] + 0.7


def test_the_bf16_default_of_a_cuda_target_is_announced(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), target_device="cuda", block_size="fixed")
    assert any("cuda GEMMs are not batch-invariant" in n for n in rt.info["notes"]), rt.info["notes"]


# ---- captured steps (CUDA graphs): float32, so that token identity is the promise ----

def graphs_runtime(target, draft=None, steps="graphs", **kw):
    from hetero_sd.backends.policy import LoadPolicy

    return hetero_sd.load(str(target), None if draft is None else str(draft), target_device="cuda", dtype=F32,
                          policy=LoadPolicy(steps=steps), **kw)


def test_captured_target_decodes_the_eager_tokens(tiny_llama):
    eager, graphs = graphs_runtime(tiny_llama, steps="eager"), graphs_runtime(tiny_llama)
    assert graphs.target.steps == "graphs" and "CUDA graphs" in graphs.target.mode
    for prompt in PROMPTS:
        want = eager.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids
        assert graphs.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids == want
    assert graphs.target.fixed.runner.captures >= 2  # the decode bucket and the prefill's


@pytest.mark.parametrize("draft_device,schedule", [("cuda", "sequential"), ("cuda", "overlap"), ("cpu", "overlap")])
def test_captured_steps_are_lossless(tiny_llama, tiny_draft, cuda_baseline, draft_device, schedule):
    rt = graphs_runtime(tiny_llama, tiny_draft, draft_device=draft_device, block_size="fixed", schedule=schedule)
    for prompt, base in zip(PROMPTS, cuda_baseline):
        out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
        assert out.stats.num_drafts > 0 and out.stats.fallback is None, out.stats.notes
        assert out.token_ids == base
    if draft_device == "cuda":
        assert rt.draft.steps == "graphs" and rt.draft.fixed.runner.captures >= 2


@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
def test_compiled_steps_captured_are_lossless(tiny_llama, tiny_draft, cuda_baseline, schedule):
    """The steps under torch.compile (Triton's kernels from inductor), then captured as CUDA graphs: the eager
    tokens in float32, the target's and the draft's steps both compiled and captured."""
    rt = graphs_runtime(tiny_llama, tiny_draft, steps="compiled", block_size="fixed", schedule=schedule)
    assert rt.target.steps == rt.draft.steps == "compiled" and "torch.compile + CUDA graphs" in rt.target.mode
    for prompt, base in zip(PROMPTS, cuda_baseline):
        out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
        assert out.stats.num_drafts > 0 and out.stats.fallback is None, out.stats.notes
        assert out.token_ids == base
    assert rt.target.fixed.runner.captures >= 2 and rt.draft.fixed.runner.captures >= 2


@pytest.mark.parametrize("draft_device,steps", [("cuda", "graphs"), ("cpu", "graphs"), ("cuda", "eager")])
def test_acceptance_on_the_device_is_lossless(tiny_llama, tiny_draft, cuda_baseline, draft_device, steps):
    """A CUDA target's greedy blocks are accepted on the device ('auto'), the drafted ids passed to the verify
    there (from a CUDA draft's argmax) or from the host (a CPU draft's): the target's tokens either way."""
    rt = graphs_runtime(tiny_llama, tiny_draft, steps=steps, draft_device=draft_device, block_size="fixed", lookup=0)
    for prompt, base in zip(PROMPTS, cuda_baseline):
        out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
        assert out.stats.acceptance == "device" and out.stats.fallback is None, out.stats.notes
        assert out.stats.device_steps == out.stats.num_drafts > 0
        assert out.token_ids == base


def test_captured_steps_cross_a_tier_and_a_grown_cache(tiny_llama, tiny_draft, monkeypatch):
    """Past 256 slots mid-generation a cache allocated at 256 grows (new memory): the captured steps are dropped
    with their pool and captured again, and the tokens stay the eager ones."""
    from hetero_sd.backends.torch_backend import layers

    monkeypatch.setattr(layers, "first_allocation", lambda *a, **kw: layers.FIRST)  # (as where it does not fit)
    long_prompt = [(7 * i) % 60 + 4 for i in range(250)]
    want = graphs_runtime(tiny_llama, steps="eager").generate(long_prompt, max_new_tokens=30, stop_at_eos=False)
    rt = graphs_runtime(tiny_llama, tiny_draft, block_size="fixed")
    out = rt.generate(long_prompt, max_new_tokens=30, stop_at_eos=False)
    assert out.token_ids == want.token_ids and out.stats.num_drafts > 0
    assert rt.target.cache.k[0].shape[2] >= 512


def test_a_cuda_cache_that_fits_is_allocated_whole_and_never_recaptured(tiny_llama):
    """Where the context limit's K/V fit, the cache is allocated whole: passing 256 positions moves no memory, so
    the captured steps are replayed, not captured again."""
    t = graphs_runtime(tiny_llama).target
    assert t.cache.k[0].shape[2] >= t.max_context
    memory = t.cache.k[0].data_ptr()
    t.forward([(7 * i) % 60 + 4 for i in range(250)])
    for _ in range(12):
        t.forward([7])
    captures = t.fixed.runner.captures
    t.crop(250)
    for _ in range(12):
        t.forward([9])
    assert t.cache.k[0].data_ptr() == memory and t.fixed.runner.captures == captures


def test_a_warm_up_captures_every_shape_a_generation_meets(tiny_llama, tiny_draft, cuda_baseline):
    """Runtime.warm() (serve's and chat's, once loaded): every step shape of the caches as allocated (whole: the
    context limit and a padded step past it), so a generation after it captures nothing and moves no memory, and
    its tokens are the eager ones."""
    rt = graphs_runtime(tiny_llama, tiny_draft, block_size="fixed")
    t, d = rt.target, rt.draft
    memory = [t.cache.k[0].data_ptr(), d.cache.k[0].data_ptr()]
    assert rt.warms() and rt.warm() > 0
    captures = [t.fixed.runner.captures, d.fixed.runner.captures]
    long = [(7 * i) % 60 + 4 for i in range(300)]
    for prompt, base in zip(PROMPTS, cuda_baseline):
        assert rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids == base
    rt.generate(long, max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert [t.fixed.runner.captures, d.fixed.runner.captures] == captures
    assert [t.cache.k[0].data_ptr(), d.cache.k[0].data_ptr()] == memory


FAILED_CAPTURE = """
import torch
from hetero_sd.backends.torch_backend.steps import Runner
from hetero_sd.errors import DeviceFailedError

x, before = torch.ones(4, device="cuda"), torch.cuda.current_stream()
for runner, key, fn in ((Runner("graphs", "cuda"), "bad", lambda: (x * float(x.sum()),)),
                        (Runner("graphs", "cuda"), "good", lambda: (x * 2,))):
    try:
        runner.run(key, fn)
        raise SystemExit(f"{key}: captured")
    except DeviceFailedError as e:
        print(key, "|", " ".join(str(e).split()))
    assert torch.cuda.current_stream() == before, key
assert Runner("fixed", "cuda").run("good", lambda: (x * 2,))[0].sum().item() == 8.0
"""


def test_a_step_that_cannot_be_captured_says_so_and_leaves_the_stream():
    """A host sync inside a capture is illegal: the error names the fix, the thread is back on the stream it was on
    (a failed capture_end leaves the capture stream current otherwise), and no later capture is tried in the process
    (torch before 2.12 leaves its allocator believing the capture is under way: the next would fail on an internal
    assert). In a process of its own, so that the failed capture cannot touch the other tests' captures."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    bad, good = done.stdout.splitlines()[-2:]
    assert bad.startswith("bad | capturing a step as a CUDA graph failed") and "HETERO_SD_STEPS=fixed" in bad
    assert good.startswith("good | no step is captured") and "HETERO_SD_STEPS=fixed" in good


def test_captured_logits_equal_eager_on_cuda(tiny_llama, tiny_draft):
    outs = []
    for steps in ("eager", "graphs"):
        t = graphs_runtime(tiny_llama, tiny_draft, steps=steps).target
        t.forward(PROMPTS[1])
        # (copies: a captured step's logits are its graph's memory, valid until the next step)
        outs.append([(lambda o: (o.logits.clone(), o.features))(t.forward(list(range(10, 10 + k)))) for k in (1, 3, 8)])
        t.crop(len(PROMPTS[1]))
    for (e_logits, e_features), (g_logits, g_features) in zip(*outs):
        torch.testing.assert_close(g_logits, e_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g_features, e_features, atol=1e-4, rtol=1e-4)


def test_costs_name_the_gpu(tiny_llama, tiny_draft):
    from hetero_sd.decoding.costs import measure_costs

    rt = graphs_runtime(tiny_llama, tiny_draft)
    costs = measure_costs(rt.target, rt.draft, context=64, ks=(1, 4), blocks=(2, 4), repeats=2, machine=True)
    assert costs.device == torch.cuda.get_device_name() and costs.floors_s["decode"] > 0
