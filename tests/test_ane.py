"""The fp16-safe draft graph (ane_compiler) and the ane-sim device: exact rewrites in float32, finite
and accurate in fp16 where a naive fp16 draft overflows, drift measured against the float32 draft."""

from __future__ import annotations

import pytest
import torch

from hetero_sd.ane_compiler.graph import SafeDraftGraph
from hetero_sd.backends.coreml import AneSimDraft
from hetero_sd.backends.torch_backend import load_draft
from hetero_sd.models.config import DraftConfig
from hetero_sd.errors import DeviceUnavailableError, UnknownDeviceError
from hetero_sd.runtime import load
from hetero_sd.models.weights import load_weights

from .conftest import make_tiny_target


def context_and_block(rt, prompt_ids):
    out = rt.target.forward(prompt_ids, features=True)
    return out.features


def drafts(rt, draft_folder, dtype=torch.float32):
    return load_draft(draft_folder, DraftConfig.from_folder(draft_folder), rt.target, "cpu", dtype,
                      rt.draft.mask_token_id, load_weights(draft_folder))


def test_safe_graph_in_float32_is_the_reference_draft(tiny_llama, tiny_draft):
    """The rewrites (per-token rescaling before every square, host-side feature scaling) are exact."""
    rt = load(str(tiny_llama), str(tiny_draft), draft_dtype="float32")  # the float32 reference draft
    features = context_and_block(rt, [5, 9, 12, 20, 7, 33])
    reference = rt.draft
    reference.crop(0)
    reference.add_context(features)
    expected = reference.propose(11, position=8)
    exact = AneSimDraft(reference)
    exact.graph = SafeDraftGraph(reference)  # same graph, float32 arithmetic
    exact.add_context(features)
    assert torch.allclose(exact.propose(11, position=8), expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def outlier_target(tmp_path_factory):
    """A tiny Llama whose layer-0 MLP writes ~1e5 into one residual channel, as Qwen-family models do."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_target(tmp_path_factory.mktemp("outliers"))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[7] *= 3e5
    model.save_pretrained(str(folder))
    return folder


def test_ane_sim_stays_finite_where_a_naive_fp16_draft_overflows(outlier_target, tiny_draft):
    rt = load(str(outlier_target), str(tiny_draft), draft_dtype="float32")
    features = context_and_block(rt, [5, 9, 12, 20, 7, 33, 41, 2])
    assert features.abs().max() > 1e5  # beyond fp16's 65504
    reference = rt.draft
    reference.add_context(features)
    expected = reference.propose(11)

    naive = drafts(rt, tiny_draft, torch.float16)
    naive.add_context(features)
    assert not torch.isfinite(naive.propose(11)).all()

    sim = AneSimDraft(reference)
    sim.add_context(features)
    got = sim.propose(11)
    assert torch.isfinite(got).all()
    cosine = torch.nn.functional.cosine_similarity(sim.last_hidden, reference.last_hidden, dim=-1)
    assert cosine.min() > 0.999
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_ane_sim_decodes_losslessly_and_reports_drift(tiny_llama, tiny_draft):
    rt = load(str(tiny_llama), str(tiny_draft), draft_device="ane-sim", block_size="fixed")
    assert rt.info["draft_device"] == "ane-sim" and any("EMULATION" in n for n in rt.notes)
    base = rt.generate([5, 9, 12], max_new_tokens=20, speculative=False)
    spec = rt.generate([5, 9, 12], max_new_tokens=20)
    assert spec.token_ids == base.token_ids
    drift = spec.stats.to_dict()["drift"]
    assert drift["blocks"] == spec.stats.num_drafts and drift["cosine"] > 0.999
    assert 0.0 <= drift["top1_agreement"] <= 1.0 and drift["kl"] >= 0.0


def test_ane_devices_say_where_they_run():
    from hetero_sd.devices import check_device

    assert check_device("ane-sim") == "ane-sim"
    with pytest.raises(UnknownDeviceError, match="drafts only"):
        check_device("ane-sim", "target")
    import platform
    if platform.system() != "Darwin":
        with pytest.raises(DeviceUnavailableError) as e:
            check_device("ane")
        assert "ane-sim" in e.value.fix


def test_bench_on_ane_sim_reports_drift(tmp_path, tiny_llama, tiny_draft):
    import json

    from hetero_sd.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5 t9 t12"}\n{"prompt": "t20 t7"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--draft-device", "ane-sim",
                 "--prompts", str(prompts), "--max-new-tokens", "12", "--block-size", "fixed", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["lossless"] is True and res["models"]["draft_device"] == "ane-sim"
    drift = res["drift"]
    assert {"tau_ratio", "cosine", "top1_agreement", "kl"} <= set(drift)
    assert drift["cosine"] > 0.999 and drift["tau_reference"] > 0


def test_compile_ane_writes_a_package_coremltools_reopens(tmp_path, tiny_llama, tiny_draft):
    ct = pytest.importorskip("coremltools")
    import json

    from hetero_sd.cli import main

    out = tmp_path / "draft.mlpackage"
    assert main(["compile-ane", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--out", str(out),
                 "--window", "32"]) == 0
    model = ct.models.MLModel(str(out), skip_model_load=True)
    names = [f.name for f in model.get_spec().description.input]
    assert names[:2] == ["block_embeddings", "features"]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["inputs"]["features"] == [1, 3 * 64, 1, 32] and report["outputs"]["logits"] == [1, 64, 1, 5]
    assert report["ane_unfriendly"] == {} and "gather" not in report["ops"] and "tile" not in report["ops"]
    assert report["ops"].get("conv", 0) >= 2 * 4 + 2  # linear layers are 1x1 convolutions
    assert report["drift_vs_float32"]["cosine"] > 0.999


class GraphAsPackage:
    """Stands in for coremltools' MLModel (prediction needs macOS): runs the same graph in float32 on
    the padded, masked inputs the Core ML device builds."""

    def __init__(self, graph):
        self.graph = graph

    def predict(self, inputs: dict) -> dict:
        tensors = [torch.from_numpy(inputs[k]) for k in ("block_embeddings", "features", "feature_eps", "ctx_cos",
                                                        "ctx_sin", "blk_cos", "blk_sin", "ctx_bias")]
        logits, hidden = self.graph(*tensors)
        return {"logits": logits.numpy(), "hidden": hidden.numpy()}


def test_core_ml_device_pads_and_masks_the_window_exactly(tiny_llama, tiny_draft):
    from hetero_sd.backends.coreml.device import CoreMLDraft

    rt = load(str(tiny_llama), str(tiny_draft), draft_dtype="float32")
    features = context_and_block(rt, [5, 9, 12, 20, 7, 33])
    reference = rt.draft
    reference.add_context(features)
    expected = reference.propose(11)
    package = CoreMLDraft(reference, GraphAsPackage(SafeDraftGraph(reference)), "ane", window=16)
    package.add_context(features)  # 6 positions in a 16-slot window: 10 padded, masked slots
    assert torch.allclose(package.propose(11), expected, atol=1e-4, rtol=1e-4)
