"""The MLX backend (on Linux: MLX's CPU build) against the torch backend: same logits, same features,
same draft proposals, and identical greedy output in every placement."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("mlx.core")

from hetero_sd.runtime import load  # noqa: E402

PROMPT = [5, 9, 12, 20, 7, 33]


@pytest.fixture(scope="module")
def reference(tiny_llama, tiny_draft):
    return load(str(tiny_llama), str(tiny_draft), draft_dtype="float32")  # the float32 torch draft


@pytest.mark.parametrize("target_fixture", ["tiny_llama", "tiny_qwen3"])
def test_mlx_target_matches_torch(request, target_fixture):
    folder = str(request.getfixturevalue(target_fixture))
    torch_rt, mlx_rt = load(folder, "random"), load(folder, "random", target_device="mlx")
    a = torch_rt.target.forward(PROMPT)
    b = mlx_rt.target.forward(PROMPT)
    assert torch.allclose(a.logits, b.logits, atol=1e-4) and torch.allclose(a.features, b.features, atol=1e-4)
    a2, b2 = torch_rt.target.forward([3, 4]), mlx_rt.target.forward([3, 4])  # a verify on top of the cache
    assert torch.allclose(a2.logits, b2.logits, atol=1e-4)


def test_mlx_draft_matches_torch(reference, tiny_llama, tiny_draft):
    mlx_rt = load(str(tiny_llama), str(tiny_draft), draft_device="mlx")
    features = reference.target.forward(PROMPT).features
    for rt in (reference, mlx_rt):
        rt.draft.crop(0)
        rt.draft.add_context(features[:4])
        rt.draft.add_context(features[4:])  # context arrives in pieces, as in decoding
    assert torch.allclose(reference.draft.propose(11), mlx_rt.draft.propose(11), atol=1e-4)
    assert torch.allclose(reference.draft.propose(11, position=9, size=4),
                          mlx_rt.draft.propose(11, position=9, size=4), atol=1e-4)


@pytest.mark.parametrize("placement", [("cpu", "mlx"), ("mlx", "cpu"), ("mlx", "mlx")])
def test_every_placement_is_lossless(reference, tiny_llama, tiny_draft, placement):
    target_device, draft_device = placement
    rt = load(str(tiny_llama), str(tiny_draft), target_device=target_device, draft_device=draft_device)
    base = reference.generate([5, 9, 12], max_new_tokens=24, speculative=False)
    for schedule in ("sequential", "overlap"):
        out = rt.generate([5, 9, 12], max_new_tokens=24, schedule=schedule, block="fixed")
        assert out.token_ids == base.token_ids and out.stats.num_drafts > 0


# ---- steps under mx.compile (fixed shapes): the same tokens and logits as the eager MLX steps ----

def mlx_runtime(tiny_llama, tiny_draft, steps, **kw):
    from hetero_sd.backends.policy import LoadPolicy

    return load(str(tiny_llama), str(tiny_draft), target_device="mlx", draft_device="mlx",
                policy=LoadPolicy(steps=steps), **kw)


def test_compiled_mlx_steps_match_eager(tiny_llama, tiny_draft):
    eager, compiled = (mlx_runtime(tiny_llama, tiny_draft, s) for s in ("eager", "fixed"))
    assert eager.target.steps == "eager" and compiled.target.steps == compiled.draft.steps == "compiled"
    outs = []
    for rt in (eager, compiled):
        first = rt.target.forward(PROMPT)
        verify = rt.target.forward([3, 4, 5])  # padded to a bucket of 4
        rt.target.crop(len(PROMPT) + 1)
        after = rt.target.forward([8])
        rt.draft.add_context(first.features)
        rt.draft.add_context(verify.features[:1])
        outs.append((first, verify, after, rt.draft.propose(11), rt.draft.propose(11, position=9, size=4)))
    for e, c in zip(*outs):
        if hasattr(e, "logits"):
            assert torch.allclose(e.logits, c.logits, atol=1e-4) and torch.allclose(e.features, c.features, atol=1e-4)
        else:
            assert torch.allclose(e, c, atol=1e-4)


@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
def test_compiled_mlx_steps_are_lossless(reference, tiny_llama, tiny_draft, schedule):
    rt = mlx_runtime(tiny_llama, tiny_draft, "fixed")
    long_prompt = [(7 * i) % 60 + 4 for i in range(250)]  # the cache grows and the tier doubles mid-generation
    for prompt in ([5, 9, 12], long_prompt):
        base = reference.generate(prompt, max_new_tokens=24, speculative=False, stop_at_eos=False)
        out = rt.generate(prompt, max_new_tokens=24, schedule=schedule, block="fixed", stop_at_eos=False)
        assert out.token_ids == base.token_ids and out.stats.num_drafts > 0


def test_a_warm_up_compiles_every_shape_a_generation_meets(reference, tiny_llama, tiny_draft, monkeypatch):
    """Runtime.warm on mx.compile steps: each (rows, tier) of the target and each block and catch-up shape of the
    draft traced before the first answer (its first slots, where nothing is allocated yet, and as far as asked),
    the tokens unchanged; a fork (requests at once) shares the compiled functions. A trace runs the step's Python
    function, so the traces are counted there: none may happen after the warm-up."""
    from hetero_sd.backends.mlx_backend import steps

    traces = []
    for cls, name in ((steps.TargetSteps, "step"), (steps.DraftSteps, "block_step"), (steps.DraftSteps, "context_step")):
        def counted(self, *args, real=getattr(cls, name), name=name):
            traces.append(name)
            return real(self, *args)
        monkeypatch.setattr(cls, name, counted)
    rt = mlx_runtime(tiny_llama, tiny_draft, "fixed", block_size="fixed")
    assert rt.warms() and not mlx_runtime(tiny_llama, tiny_draft, "eager").warms()
    long_prompt = [(7 * i) % 60 + 4 for i in range(250)]  # grows past the first slots: a second tier
    assert rt.warm() > 0 and rt.warm(len(long_prompt) + 24) > 0
    warmed = len(traces)
    assert warmed >= len(rt.target.compiled.fns) + len(rt.draft.compiled.fns)
    for prompt in ([5, 9, 12], long_prompt):
        base = reference.generate(prompt, max_new_tokens=24, speculative=False, stop_at_eos=False)
        out = rt.generate(prompt, max_new_tokens=24, stop_at_eos=False)
        assert out.token_ids == base.token_ids and out.stats.num_drafts > 0
    assert traces[warmed:] == []  # nothing traced since
    twin = rt.target.fork()
    assert twin.compiled.fns is rt.target.compiled.fns and twin.cache is not rt.target.cache


@pytest.mark.parametrize("steps", ["eager", "fixed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_runs_on_any_thread(tiny_llama, tiny_draft, steps, dtype):
    """MLX ties an array not yet computed to the thread that made it: a model loaded on one thread runs its jobs on
    the lanes' threads, and a server's requests on theirs. Loaded here, a step on one thread, a warm-up on another,
    generations on a third and here: the same tokens (a bfloat16 model's weights are converted when loaded: they
    were left uncomputed; the compiled steps' cache writes too)."""
    from concurrent.futures import ThreadPoolExecutor

    rt = mlx_runtime(tiny_llama, tiny_draft, steps, block_size="fixed", dtype=dtype)

    def elsewhere(fn):
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(fn).result()
    elsewhere(lambda: rt.target.forward(PROMPT))
    elsewhere(lambda: rt.warm(64))
    generate = partial(rt.generate, [5, 9, 12], max_new_tokens=12, stop_at_eos=False)
    assert elsewhere(lambda: generate().token_ids) == generate().token_ids


EXITS = """
import sys
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.runtime import load
rt = load(sys.argv[1], sys.argv[2], target_device="mlx", draft_device="mlx", policy=LoadPolicy(steps="fixed"))
rt.warm(32)
print(len(rt.generate([5, 9, 12], max_new_tokens=8, stop_at_eos=False).token_ids))
if sys.argv[3] == "closed":
    rt.close()
elif sys.argv[3] == "dropped":
    import gc
    del rt
    gc.collect()
"""


def test_a_process_that_ran_compiled_steps_on_a_lane_exits_cleanly(tiny_llama, tiny_draft):
    """A lane's thread that ran MLX work releases its streams before it ends (at close, when its runtime is
    dropped unclosed, or at interpreter exit): one that ended holding them aborted most exits after compiled steps
    (MLX 0.32's CPU build). The abort came on most exits, not all: two processes of each ending must exit cleanly."""
    import subprocess
    import sys

    for ending in ("open", "closed", "dropped") * 2:
        done = subprocess.run([sys.executable, "-c", EXITS, str(tiny_llama), str(tiny_draft), ending],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.split()[-1] == "8", done.stderr[-2000:]
