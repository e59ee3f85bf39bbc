"""`hetero-sd compile-ane`: convert a runtime's draft to a Core ML package (hetero_sd.ane_compiler) and
report its ops, inputs and fp16 drift against the float32 draft."""

from __future__ import annotations

import json
from pathlib import Path

from hetero_sd.ane_compiler.compile import convert, io_report, op_report
from hetero_sd.backends.coreml import AneSimDraft
from hetero_sd.backends.drift import Drift
from hetero_sd.errors import ConfigError
from hetero_sd.runtime import load

from .policy import policy_from_env


def drift_report(runtime, prompts: list[str], window: int) -> dict:
    """ane-sim (the same graph, every op rounded to fp16) against the float32 draft, on contexts the
    target produces for `prompts`: the first block after each prompt."""
    reference, meter = runtime.draft, Drift("ane-sim")
    sim = AneSimDraft(reference, window)
    for prompt in prompts:
        ids, _ = runtime.encode(prompt)
        out = runtime.target.forward(ids, features=True)  # the runtime's target, on its own cache
        anchor = int(out.logits[-1].argmax())
        reference.crop(0)
        sim.crop(0)
        for draft in (reference, sim):
            draft.add_context(out.features)
        meter.add(reference.propose(anchor), sim.propose(anchor), reference.last_hidden, sim.last_hidden)
        runtime.target.crop(0)
    return meter.to_dict()


DRIFT_PROMPTS = ["Write a haiku about the sea.", "Explain how a hash map works.",
                 "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
                 "List three uses of copper."]


def compile_ane(target: str, draft: str, out: Path, window: int = 512) -> dict:
    """Convert the draft to `out` (.mlpackage) and return the report (also written next to it as JSON)."""
    runtime = load(target, draft, policy=policy_from_env())
    if runtime.draft is None:
        raise ConfigError("compile-ane needs a draft", "pass --draft FOLDER (a DFlash draft for the target)")
    model = convert(runtime.draft, out, window)
    report = {"package": str(out), "target": runtime.info["target"], "draft": runtime.info["draft"],
              "block_size": runtime.draft.block_size, "window": window, "precision": "fp16 ML program",
              **io_report(model), **op_report(model),
              "drift_vs_float32": drift_report(runtime, DRIFT_PROMPTS, window),
              "rewrites": ["context features divided per token by max|x| on the host (fc + RMSNorm invariant)",
                           "every RMSNorm divides its input by its per-token max|x| before squaring",
                           "q scaled by 1/sqrt(head_dim) before q.k; masks add -1e4, not finfo(f32).min",
                           "token embeddings looked up on the host (no vocabulary gather in the package)"]}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    return report
