"""How far the default target's float32 path is from the exact model (transformers in float64), over
several random id sequences: the margin behind tests/test_parity.py::test_smollm2_matches_transformers,
which checks one fixed sequence. Per seed: max |logit diff|, max |feature diff|, and the features' excess
over the test's tolerance (max of |diff| - 1e-4 * |exact|; the test allows 1e-4).

    python benchmarks/parity_sweep.py [--seeds 8] [--json out.json]
    HETERO_SD_QUANT=off python benchmarks/parity_sweep.py   # torch's float32 matmuls instead of the GGUF kernels
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hetero_sd.bench.runner import machine
from tests.test_parity import hf_reference, ours_in_chunks

LAYERS, CHUNKS = [1, 8, 14, 20, 27], [28, 16, 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    import functools

    import tests.test_parity as parity
    from hetero_sd.cli.policy import policy_from_env
    from hetero_sd.loading.default_model import default_target_folder
    # the HETERO_SD_* switches reach the target as the CLI passes them: a load policy
    parity.load_target = functools.partial(parity.load_target, policy=policy_from_env())
    folder = default_target_folder()
    rows = []
    for seed in range(args.seeds):
        ids = torch.randint(0, 49152, (45,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref_logits, hidden = hf_reference(folder, ids, torch.float64)
        logits, feats = ours_in_chunks(folder, ids, LAYERS, CHUNKS)
        ref = torch.cat([hidden[k + 1][0] for k in LAYERS], -1)
        rows.append({"seed": seed, "logits_max_diff": (logits - ref_logits).abs().max().item(),
                     "features_max_diff": (feats - ref).abs().max().item(),
                     "features_excess": ((feats - ref).abs() - 1e-4 * ref.abs()).max().item()})
        print(json.dumps(rows[-1]))
    out = {"machine": machine(), "quant": os.environ.get("HETERO_SD_QUANT", "on"), "seeds": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
