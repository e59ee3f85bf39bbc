"""Fixed-shape steps (torch_backend/steps.py): what CUDA captures as graphs, run eagerly on the CPU here. They
must decode exactly as today's steps do: the same tokens for every placement and schedule, logits within float
rounding, the draft's proposals the same, and the padded buckets harmless."""

from __future__ import annotations

import pytest
import torch

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.backends.torch_backend.steps import BUCKETS, PREFILL, bucket, steps_mode

PROMPTS = [[5, 9, 12, 7], [33, 2, 40, 41, 8, 19, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 34, 35], [60, 61]]
MAX_NEW = 40
F32 = torch.float32
# torch ops (the fused C++ ops take a start, not positions) in float32, as the CUDA path runs them
EAGER = LoadPolicy(fused=False, quant=False, steps="eager")
FIXED = LoadPolicy(fused=False, quant=False, steps="fixed")
# torch.compile traces torch's matmuls, not the native CPU kernels (packed GEMM, int8 heads and layers)
COMPILED = LoadPolicy(fused=False, quant=False, gemm=False, draft_int8_head=False, draft_int8_layers=False,
                      steps="compiled")


def load(target, draft=None, policy=EAGER, **kw):
    return hetero_sd.load(str(target), None if draft is None else str(draft), dtype=F32, policy=policy, **kw)


@pytest.fixture(scope="module")
def eager_tokens(tiny_llama):
    rt = load(tiny_llama)
    return [rt.generate(p, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids for p in PROMPTS]


def test_buckets_round_rows_up():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket(BUCKETS[-1] + 1) is None


def test_step_modes_by_device():
    assert steps_mode("auto", "cpu", True) == ("eager", None)
    assert steps_mode("auto", "cuda:0", True) == ("graphs", None)
    mode, note = steps_mode("graphs", "cpu", True)
    assert mode == "fixed" and "CUDA" in note
    mode, note = steps_mode("auto", "cuda", False)
    assert mode == "eager" and "fused" in note
    with pytest.raises(ValueError, match="step mode"):
        steps_mode("fast", "cpu", True)
    assert steps_mode("compiled", "cuda", True) == steps_mode("compiled", "cpu", True) == ("compiled", None)
    mode, note = steps_mode("compiled", "cpu", True, torch_matmuls=False)
    assert mode == "fixed" and "native CPU kernels" in note


def test_compiled_steps_are_lossless(tiny_llama, tiny_draft, eager_tokens):
    """The fixed steps under torch.compile (inductor's C++ kernels here, Triton's on CUDA, where they are then
    captured): the eager tokens for both schedules, across prefill chunks, a grown cache and a doubled tier, in a
    few compilations shared by every model of the same shapes."""
    from torch._dynamo.utils import counters

    long_prompt = [(7 * i) % 60 + 4 for i in range(2 * PREFILL[-1] + 37)]
    want = load(tiny_llama).generate(long_prompt, max_new_tokens=60, stop_at_eos=False).token_ids
    for schedule in ("sequential", "overlap"):
        rt = load(tiny_llama, tiny_draft, policy=COMPILED, block_size="fixed", schedule=schedule)
        assert rt.target.steps == rt.draft.steps == "compiled" and "torch.compile" in rt.target.mode
        for prompt, base in zip(PROMPTS, eager_tokens):
            out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
            assert out.stats.num_drafts > 0 and out.stats.fallback is None, out.stats.notes
            assert out.token_ids == base
        out = rt.generate(long_prompt, max_new_tokens=60, stop_at_eos=False)
        assert out.token_ids == want and rt.target.cache.k[0].shape[2] >= 512
    graphs = counters["stats"]["unique_graphs"]
    rt = load(tiny_llama, tiny_draft, policy=COMPILED, block_size="fixed")
    assert rt.generate(PROMPTS[1], max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids == eager_tokens[1]
    assert counters["stats"]["unique_graphs"] == graphs  # a new model of these shapes compiles nothing


def test_a_step_that_does_not_compile_whole_is_an_error():
    """A graph break (Python that Dynamo cannot trace: here an explicit break) would run part of the step
    eagerly: it is a one-line error naming the fix, never a silent partial compilation."""
    from hetero_sd.backends.torch_backend.steps import compiled
    from hetero_sd.errors import DeviceFailedError

    x = torch.ones(4)

    def broken():
        y = x * 2
        torch._dynamo.graph_break()
        return (y + 1,)
    step = compiled(broken, "test")
    with pytest.raises(DeviceFailedError, match="torch.compile of the test step failed") as e:
        step()
    assert "HETERO_SD_STEPS=graphs" in str(e.value) and "\n" not in str(e.value).split(" (fix")[0]


def test_fixed_target_decodes_the_eager_tokens(tiny_llama, eager_tokens):
    rt = load(tiny_llama, policy=FIXED)
    assert rt.target.steps == "fixed" and "fixed-shape steps" in rt.target.mode
    for prompt, base in zip(PROMPTS, eager_tokens):
        assert rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids == base


@pytest.mark.parametrize("count", [1, 3, 5, 16])
def test_fixed_verify_logits_match_eager(tiny_llama, tiny_draft, count):
    """A verify of `count` rows (padded up to its bucket) after a prompt: logits and context features as
    the eager step's, and the next step unaffected by the padding rows' cache writes."""
    eager, fixed = (load(tiny_llama, tiny_draft, policy=p).target for p in (EAGER, FIXED))
    prompt, block, after = PROMPTS[1], list(range(10, 10 + count)), [44]
    outs = []
    for t in (eager, fixed):
        t.forward(prompt)
        verify = t.forward(block)
        verify.logits = verify.logits.clone()  # (a step's logits are valid until its next: TargetOutput)
        t.crop(len(prompt) + 1)  # one accepted: the rest of the block (and any padding) is rejected
        outs.append((verify, t.forward(after)))
    (ev, ea), (fv, fa) = outs
    assert fv.logits.shape == ev.logits.shape and fv.features.shape == ev.features.shape
    torch.testing.assert_close(fv.logits, ev.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fv.features, ev.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fa.logits, ea.logits, atol=1e-5, rtol=1e-5)


def test_a_long_prompt_is_prefilled_in_padded_chunks(tiny_llama, tiny_draft):
    """A prompt past the largest step bucket goes through in chunks of PREFILL[-1] rows, the last one padded up to
    its bucket: every row's logits and context features as the eager prefill's, the last row alone where only it is
    asked for, and the generation after it the eager one's."""
    prompt = [(7 * i) % 60 + 4 for i in range(2 * PREFILL[-1] + 37)]
    eager, fixed = (load(tiny_llama, tiny_draft, policy=p) for p in (EAGER, FIXED))
    steps, rows = fixed.target.fixed, []
    step = steps.step
    steps.step = lambda n, t: rows.append(n) or step(n, t)
    want, got = eager.target.forward(prompt), fixed.target.forward(prompt)
    assert rows == [PREFILL[-1], PREFILL[-1], 64]  # 37 rows left: the bucket of 64
    assert got.logits.shape == want.logits.shape and got.features.shape == want.features.shape
    # (float32 sums in other shapes over 293 positions: within 1e-4, as the CUDA test holds captured steps)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.features, want.features, atol=1e-4, rtol=1e-4)
    fixed.target.crop(0)
    last = fixed.target.forward(prompt, last_only=True)
    assert fixed.target.length == len(prompt) and last.logits.shape[0] == 1
    torch.testing.assert_close(last.logits, got.logits[-1:], atol=1e-5, rtol=1e-5)  # (the head on 1 row, not 37)
    for rt in (eager, fixed):
        rt.target.crop(0)
    runs = [rt.generate(prompt, max_new_tokens=24, stop_at_eos=False) for rt in (eager, fixed)]
    assert runs[0].token_ids == runs[1].token_ids and runs[1].stats.num_drafts > 0


@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
def test_fixed_target_and_draft_are_lossless(tiny_llama, tiny_draft, eager_tokens, schedule):
    rt = load(tiny_llama, tiny_draft, policy=FIXED, block_size="fixed", schedule=schedule)
    assert rt.draft.steps == "fixed"
    for prompt, base in zip(PROMPTS, eager_tokens):
        out = rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False)
        assert out.stats.num_drafts > 0 and out.stats.fallback is None, out.stats.notes
        assert out.token_ids == base


def test_fixed_draft_proposes_as_eager(tiny_llama, tiny_draft):
    """The draft's block after a catch-up of a few positions (a bucket) and of a whole prompt (eager), at
    every block size the controller may pick, and a pre-drafted block on a lagged context."""
    pair = {}
    for name, policy in (("eager", EAGER), ("fixed", FIXED)):
        rt = load(tiny_llama, tiny_draft, policy=policy, block_size="fixed")
        t, d = rt.target, rt.draft
        out = t.forward(PROMPTS[1])
        d.add_context(out.features)
        more = t.forward([44, 45, 46])
        d.add_context(more.features)
        blocks = [d.propose(47, size=s) for s in range(2, d.block_size + 1)]
        blocks.append(d.propose(48, position=d.context_length + 2))
        pair[name] = blocks
    for e, f in zip(pair["eager"], pair["fixed"]):
        torch.testing.assert_close(f, e, atol=1e-5, rtol=1e-5)
        assert f.argmax(-1).tolist() == e.argmax(-1).tolist()


def test_fixed_steps_sample_as_eager(tiny_llama, tiny_draft):
    """Seeded sampling: keyed by position, the same logits give the same draws."""
    outs = []
    for policy in (EAGER, FIXED):
        rt = load(tiny_llama, tiny_draft, policy=policy, block_size="fixed")
        outs.append([rt.generate(p, max_new_tokens=MAX_NEW, stop_at_eos=False, temperature=0.8, top_p=0.95, seed=7).token_ids
                     for p in PROMPTS])
    assert outs[0] == outs[1]


def test_steps_cross_a_tier_and_a_grown_cache(tiny_llama, tiny_draft):
    """A context that passes 256 slots mid-generation: the cache grows (new memory), the attended tier doubles,
    the steps are set up again, and the tokens stay the eager ones."""
    long_prompt = [(7 * i) % 60 + 4 for i in range(250)]
    want = load(tiny_llama).generate(long_prompt, max_new_tokens=30, stop_at_eos=False).token_ids
    rt = load(tiny_llama, tiny_draft, policy=FIXED, block_size="fixed")
    out = rt.generate(long_prompt, max_new_tokens=30, stop_at_eos=False)
    assert out.token_ids == want and out.stats.num_drafts > 0
    assert rt.target.cache.k[0].shape[2] >= 512


def test_tiers_are_powers_of_two_within_the_allocation():
    from hetero_sd.backends.torch_backend.steps import tier

    assert [tier(n, 4096) for n in (1, 256, 257, 600, 4000)] == [256, 256, 512, 1024, 4096]
    assert tier(300, 320) == 320


def test_a_cuda_cache_is_allocated_whole_where_it_fits():
    """The captured steps read the cache where it lies (a grown cache is captured again): on CUDA a cache takes
    its whole context limit at once where that is at most a quarter of the free memory; elsewhere, and where it
    does not fit, 256 positions grown by doubling."""
    from hetero_sd.backends.torch_backend.layers import FIRST, first_allocation

    per_position = 30 * 2 * 3 * 64 * 2  # the 135M default in bf16: 23 KB
    assert first_allocation("cuda:0", 8192, per_position, free_bytes=4 * 8192 * per_position) == 8192
    assert first_allocation("cuda:0", 8192, per_position, free_bytes=4 * 8192 * per_position - 1) == FIRST
    assert first_allocation("cuda", 100, per_position, free_bytes=10**12) == FIRST  # never below the first tier
    assert first_allocation("cpu", 8192, per_position, free_bytes=10**12) == FIRST


def test_fork_has_its_own_fixed_cache(tiny_llama, eager_tokens):
    rt = load(tiny_llama, policy=FIXED)
    twin = rt.target.fork()
    assert twin.fixed is not rt.target.fixed and twin.fixed.cache is twin.cache
    assert twin.cache.k[0].data_ptr() != rt.target.cache.k[0].data_ptr()


def test_the_comparison_catches_padding_that_leaks(tiny_llama, eager_tokens, monkeypatch):
    """Mutation check: a mask that lets the rows see every slot (the padding's and stale ones) must change
    the output."""
    from hetero_sd.backends.torch_backend import steps

    def leaky(self, rows, t):
        ids, positions = self.inputs[0:1, :rows], self.inputs[1, :rows]
        mask = torch.ones(rows, t, dtype=torch.bool)
        normed, captured = self.model(ids, self.cache, positions, self.slots.cos[positions],
                                      self.slots.sin[positions], mask, self.capture, ops=self.ops)
        logits = self.model.logits(normed[0])
        return logits, self.gather(captured), logits.argmax(-1)

    monkeypatch.setattr(steps.TargetSteps, "step", leaky)
    rt = load(tiny_llama, policy=FIXED)
    assert [rt.generate(p, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids for p in PROMPTS] != eager_tokens


def test_the_cli_variable_picks_the_step_mode():
    from hetero_sd.cli.policy import policy_from_env
    from hetero_sd.errors import ConfigError

    assert policy_from_env({}).steps == "auto" and policy_from_env({"HETERO_SD_STEPS": "eager"}).steps == "eager"
    with pytest.raises(ConfigError, match="HETERO_SD_STEPS"):
        policy_from_env({"HETERO_SD_STEPS": "turbo"})


def test_a_bench_captures_no_step_inside_a_timed_prompt(tiny_llama, tiny_draft, monkeypatch):
    """Where steps are captured on a shape's first use, bench runs every shape before its timed runs
    (Runtime.warm: each step bucket and tier up to the longest prompt and its answer, each block size, each
    catch-up): none is new inside a timed prompt, whatever block sizes the controller chooses there."""
    from hetero_sd.backends.torch_backend.steps import Runner
    from hetero_sd.bench import runner as bench_runner
    from hetero_sd.prompts import Prompt

    rt = load(tiny_llama, tiny_draft, policy=FIXED)  # (uncaptured here: the keys are what CUDA captures)
    seen, new_when_timed, timed = set(), [], [False]
    real_run, real_warm = Runner.run, bench_runner.warm_shapes

    def run(self, key, fn):
        if timed[0] and (id(self), key) not in seen:
            new_when_timed.append(key)
        seen.add((id(self), key))
        return real_run(self, key, fn)

    def warm(*args):
        real_warm(*args)
        timed[0] = True

    monkeypatch.setattr(Runner, "run", run)
    monkeypatch.setattr(bench_runner, "warm_shapes", warm)
    prompts = [Prompt("t5 t9 t12 t7"), Prompt(" ".join(f"t{i % 50 + 3}" for i in range(40))), Prompt("t20 t7")]
    res = bench_runner.run_bench(rt, prompts, max_new_tokens=40)
    assert res["spec_tokens_per_s"] > 0 and timed[0]
    assert new_when_timed == []


def test_a_warm_up_of_the_caches_as_allocated_grows_none(tiny_llama, tiny_draft):
    """Runtime.warm() (serve's and chat's): the shapes of the caches as they are allocated (the whole context
    where a CUDA cache fits whole), none grown; a cache for fixed steps holds a padded step's rows past the
    context, so that no step near its end grows a cache allocated whole."""
    from hetero_sd.backends.torch_backend.steps import PAST

    rt = load(tiny_llama, tiny_draft, policy=FIXED, block_size="fixed")
    caches = [m.cache for m in (rt.target, rt.draft)]
    sizes = [c.k[0].shape[2] for c in caches]
    assert rt.warm() > 0 and [c.k[0].shape[2] for c in caches] == sizes
    assert [c.limit for c in caches] == [rt.target.max_context + PAST] * 2
    assert load(tiny_llama, tiny_draft, policy=EAGER).target.cache.limit == rt.target.max_context


def test_after_a_warm_up_a_generation_meets_no_new_shape(tiny_llama, tiny_draft, eager_tokens, monkeypatch):
    """What Runtime.warm() ran is every (rows, tier) and block shape a generation within the caches meets: none is
    new after it (on CUDA: nothing captured inside an answer), and the tokens stay the eager ones."""
    from hetero_sd.backends.torch_backend.steps import Runner

    rt = load(tiny_llama, tiny_draft, policy=FIXED, block_size="fixed")
    seen, new, real_run = set(), [], Runner.run

    def run(self, key, fn):
        if warmed and (id(self), key) not in seen:
            new.append(key)
        seen.add((id(self), key))
        return real_run(self, key, fn)

    warmed = False
    monkeypatch.setattr(Runner, "run", run)
    rt.warm()
    warmed = True
    for prompt, base in zip(PROMPTS, eager_tokens):
        assert rt.generate(prompt, max_new_tokens=MAX_NEW, stop_at_eos=False).token_ids == base
    assert new == []


def test_a_warm_up_for_requests_at_once_forks_their_pairs(tiny_llama, tiny_draft, eager_tokens):
    """warm(pairs=n): n free target/draft pairs, each with caches and steps of its own, all warmed; the tokens of
    requests at once stay the eager ones."""
    from hetero_sd.errors import InvalidArgumentError

    rt = load(tiny_llama, tiny_draft, policy=FIXED, block_size="fixed")
    one = rt.warm()
    assert rt.warm(pairs=3) == 3 * one and len(rt.slots.free) == 3
    assert len({id(t.fixed) for t, _ in rt.slots.free}) == len({id(d.cache) for _, d in rt.slots.free}) == 3
    outs = rt.generate_many(PROMPTS, max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert [o.token_ids for o in outs] == eager_tokens and len(rt.slots.free) == 3
    with pytest.raises(InvalidArgumentError, match="pairs"):
        rt.warm(pairs=0)


def test_where_a_warm_up_pays(tiny_llama, tiny_draft):
    """Runtime.warms: captured or compiled steps cost something on a shape's first use; fixed and eager ones not;
    and a model must be able to run its shapes ahead (torch's fixed steps can)."""
    rt = load(tiny_llama, tiny_draft)
    for steps, warms in (({"target": "graphs", "draft": "eager"}, True), ({"target": "eager", "draft": "compiled"}, True),
                         ({"target": "fixed", "draft": "fixed"}, False), ({"target": "eager", "draft": "eager"}, False)):
        rt.info["steps"] = steps
        assert rt.warms() is warms
    rt.draft = None  # (steps said compiled, but no model to run them ahead)
    rt.info["steps"] = {"target": "eager", "draft": "compiled"}
    assert not rt.warms()


def test_warming_the_steps_leaves_the_caches_as_they_were(tiny_llama, tiny_draft, eager_tokens):
    """Runtime.warm runs its steps past what the caches hold: a prefix cached before it is reused after it, and the
    tokens stay the eager ones."""
    rt = load(tiny_llama, tiny_draft, policy=FIXED, block_size="fixed")
    rt.prefix_cache = True  # (as the server keeps it)
    first = rt.generate(PROMPTS[1], max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert rt.warm(300) > 0
    again = rt.generate(PROMPTS[1], max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert again.stats.num_cached_tokens > 0  # the prefix written before the warm-up
    assert first.token_ids == again.token_ids == eager_tokens[1]
    assert load(tiny_llama, tiny_draft).warm(300) == 0  # eager steps: nothing to run


def test_the_info_says_how_the_steps_run(tiny_llama, tiny_draft):
    assert load(tiny_llama, tiny_draft, policy=FIXED).info["steps"] == {"target": "fixed", "draft": "fixed"}
    assert load(tiny_llama, tiny_draft).info["steps"] == {"target": "eager", "draft": "eager"}


def test_warming_covers_the_steps_that_reach_past_the_context(tiny_llama, tiny_draft, monkeypatch):
    """A context that ends just short of a tier: its last verify (padded to its bucket) and its last draft block
    reach past it, into the next tier; Runtime.warm runs those too."""
    from hetero_sd.backends.torch_backend.steps import Runner

    rt = load(tiny_llama, tiny_draft, policy=FIXED, block_size="fixed")
    seen, new_when_timed, timed = set(), [], [False]
    real_run = Runner.run

    def run(self, key, fn):
        if timed[0] and (id(self), key) not in seen:
            new_when_timed.append(key)
        seen.add((id(self), key))
        return real_run(self, key, fn)

    monkeypatch.setattr(Runner, "run", run)
    prompt = [(7 * i) % 60 + 4 for i in range(230)]
    rt.warm(len(prompt) + 24)
    timed[0] = True
    out = rt.generate(prompt, max_new_tokens=24, stop_at_eos=False)
    assert out.stats.num_drafts > 0 and new_when_timed == []


def test_warming_asks_for_a_positive_whole_number_of_positions(tiny_llama):
    from hetero_sd.errors import InvalidArgumentError

    rt = load(tiny_llama)
    for bad in (0, -3, 2.5, "300"):
        with pytest.raises(InvalidArgumentError, match="positions must be"):
            rt.warm(bad)
    assert rt.warm(None) == rt.warm() == 0  # (None: the caches as allocated; eager steps warm nothing)


def test_a_wait_for_the_gpu_waits_for_a_capture_on_another_thread(monkeypatch):
    """CUDA refuses a device-wide wait while any stream captures, failing the wait and the capture alike: a lane's
    wait (a pre-draft's, a job's end) must not land inside another lane's capture. The capture holds the lock a wait
    takes, and so does dropping the captured steps (CUDA refuses to destroy a graph during a capture too)."""
    import threading

    from hetero_sd.backends import base
    from hetero_sd.backends.torch_backend import steps

    assert steps.CAPTURE is base.CAPTURE
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    capturing, done = threading.Event(), threading.Event()

    def capture():
        with base.CAPTURE:
            capturing.set()
            done.wait(10)

    holder = threading.Thread(target=capture)
    holder.start()
    capturing.wait(10)
    waits = [threading.Thread(target=base.synchronize, args=("cuda:0",)),
             threading.Thread(target=steps.Runner("graphs", "cpu").reset)]
    for w in waits:
        w.start()
    for w in waits:
        w.join(0.3)
    assert all(w.is_alive() for w in waits) and not waited  # both wait for the capture's end
    done.set()
    for w in waits + [holder]:
        w.join(10)
    assert waited == [torch.device("cuda:0")]
