"""The fp16-safe draft graph as a Core ML ML program with static shapes.

Conversion goes through torch.export (coremltools' torch.jit.trace route breaks on numpy >= 2.4).
The package takes the block's token embeddings and a fixed window of context features as inputs
(stateful KV caches are often rejected by the ANE compiler), so it has no state and no gather over the
vocabulary; the host looks up the embeddings, scales the features per token, and builds RoPE tables.
Everything is channels-first (1, C, 1, S) with 1x1 convolutions (graph.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from .graph import INPUTS, SafeDraftGraph

# MIL ops the Neural Engine does not run (Core ML places them on the CPU/GPU), with why they may stay.
ANE_UNFRIENDLY = {
    "gather": "vocabulary-sized lookups: done on the host instead",
    "gather_nd": "dynamic indexing",
    "scatter": "dynamic writes",
    "scatter_nd": "dynamic writes",
    "while_loop": "control flow",
    "cond": "control flow",
    "non_zero": "data-dependent shapes",
    "random_uniform": "randomness",
}


def example_inputs(graph: SafeDraftGraph, block: int, window: int) -> tuple[torch.Tensor, ...]:
    a, f = graph.arch, graph.w.fc.shape[1]
    return (torch.zeros(1, a.hidden_size, 1, block), torch.zeros(1, f, 1, window), torch.ones(1, 1, 1, window),
            torch.ones(1, a.head_dim, 1, window), torch.zeros(1, a.head_dim, 1, window),
            torch.ones(1, a.head_dim, 1, block), torch.zeros(1, a.head_dim, 1, block), torch.zeros(1, window, 1, 1))


def convert(draft, out: Path, window: int = 512, block: int | None = None):
    """Export and convert; returns the coremltools MLModel (saved to `out`)."""
    import coremltools as ct

    graph = SafeDraftGraph(draft)
    block = block or draft.block_size
    inputs = example_inputs(graph, block, window)
    with torch.no_grad():
        program = torch.export.export(graph.eval(), inputs).run_decompositions({})
    model = ct.convert(program, inputs=[ct.TensorType(name=n, shape=x.shape) for n, x in zip(INPUTS, inputs)],
                       outputs=[ct.TensorType(name="logits"), ct.TensorType(name="hidden")],
                       convert_to="mlprogram", compute_precision=ct.precision.FLOAT16,
                       minimum_deployment_target=ct.target.macOS14)
    model.save(str(out))
    return model


# Ops the ANE runs, but at a cost worth knowing about.
ANE_COSTLY = {
    "reshape": "a layout change (left by the einsum lowering)",
    "transpose": "k^T per head for q.k, and any layout change left by the einsum lowering",
    "tile": "repeated K/V heads",
}


def op_report(model) -> dict:
    """Op counts of the ML program; ops the ANE cannot run and ops it runs at a cost, each with its reason."""
    ops = Counter()
    for function in model._mil_program.functions.values():
        for op in function.operations:
            ops[op.op_type] += 1
    return {"ops": dict(sorted(ops.items())),
            "ane_unfriendly": {op: ANE_UNFRIENDLY[op] for op in ops if op in ANE_UNFRIENDLY},
            "ane_costly": {op: ANE_COSTLY[op] for op in ops if op in ANE_COSTLY}}


def io_report(model) -> dict:
    spec = model.get_spec().description
    shape = lambda f: list(f.type.multiArrayType.shape)
    return {"inputs": {f.name: shape(f) for f in spec.input}, "outputs": {f.name: shape(f) for f in spec.output}}
