"""Our drafts in z-lab's exact layout and the exports other runtimes load (models/draft_format.py,
loading/export_draft.py): z-lab's own loader reads the shipped draft and a freshly trained one with no
unexpected or missing key and proposes the same first block as our runtime with the full head (float32,
the same context features); llama.cpp's converter makes a GGUF of it (run by llama.cpp where a build is
found); z-lab's MLX reader loads the MLX export; and our names and config keys are held against the
weight loaders of vLLM, SGLang and dflash-mlx (read from their source, cited below)."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hetero_sd
from hetero_sd.backends.policy import LoadPolicy
from hetero_sd.cli import main
from hetero_sd.errors import ConfigError, WeightsError
from hetero_sd.loading.export_draft import converter, draft_folder, export_draft
from hetero_sd.models import draft_vocab
from hetero_sd.models.config import DraftConfig
from hetero_sd.models.draft_format import EXTENSION, read_config, read_tensors

SHIPPED = "cpu-trained"
PROMPT = [5, 9, 12, 7, 30, 2, 8]
# float32, the full head, no GGUF blocks or int8 rows: the draft as z-lab's loader computes it
FULL = LoadPolicy(quant=False, draft_int8_head=False, draft_int8_layers=False, draft_vocab=False)


def zlab():
    return pytest.importorskip("dflash.model", reason="z-lab's reference: pip install --no-deps dflash (make setup)")


def zlab_load(folder: Path):
    """z-lab's DFlashDraftModel.from_pretrained, float32, with transformers' loading report."""
    model, info = zlab().DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def assert_clean(info: dict) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def first_block(target_folder: Path, draft: Path, prompt: list[int]):
    """The first block after the prompt, drafted by z-lab's model and by our runtime's draft backend on the
    same context features (the HF target's, float32): (their logits, our logits)."""
    from transformers import AutoModelForCausalLM

    zm = zlab()
    theirs, info = zlab_load(draft)
    assert_clean(info)
    target = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        anchor = int(out.logits[0, -1].argmax())
        features = zm.extract_context_feature(out.hidden_states, theirs.target_layer_ids)
        block = torch.tensor([[anchor] + [theirs.mask_token_id] * (theirs.block_size - 1)])
        hidden = theirs(target_hidden=features, noise_embedding=target.get_input_embeddings()(block),
                        position_ids=torch.arange(len(prompt) + theirs.block_size)[None])[:, 1:, :]
        their_logits = theirs.compute_logits(hidden, target.lm_head)[0]
    rt = hetero_sd.load(str(target_folder), str(draft), dtype="float32", draft_dtype="float32", block_size="fixed",
                        lookup=0, policy=FULL)
    assert rt.info["draft_head"].split()[0] == rt.info["draft_head"].split()[2]  # the full head
    rt.draft.add_context(features[0])
    return their_logits, rt.draft.propose(anchor).float()


def chat_ids(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(chat, add_special_tokens=False)


def assert_same_proposals(theirs: torch.Tensor, ours: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)
    assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()


@pytest.fixture(scope="module")
def shipped_folder() -> Path:
    folder = draft_folder(SHIPPED)
    assert (folder / EXTENSION).is_file()  # the shipped draft carries the reduced head and short blocks beside
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama) -> Path:
    """A draft freshly trained by train-draft's trainer (short blocks on: our extension file is written)."""
    from hetero_sd.train.trainer import TrainConfig, train

    rows = [{"index": i, "prompt_ids": [5, 6, 7], "response_ids": list(range(8, 20))} for i in range(8)]
    out = tmp_path_factory.mktemp("trained")
    train(tiny_llama, rows, out, TrainConfig(block_size=4, layers=1, steps=2, accumulate=1, held_out=2,
                                            eval_every=1, short_blocks=0.5))
    return out


# --- the layout -------------------------------------------------------------------------------------------

def test_shipped_draft_holds_only_zlab_keys_and_tensors(shipped_folder):
    config = json.loads((shipped_folder / "config.json").read_text())
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert not {draft_vocab.KEY, "short_blocks"} & set(config)
    names = set(load_file(str(shipped_folder / "model.safetensors")))
    assert draft_vocab.TENSOR not in names and all(re.fullmatch(ZLAB_NAME, n) for n in names), names
    fmt = DraftConfig.from_folder(shipped_folder).format  # ours are read from beside them
    assert fmt.draft_vocab_size == 8192 and fmt.short_blocks


def test_trained_draft_is_written_in_the_zlab_layout(trained):
    config = json.loads((trained / "config.json").read_text())
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert json.loads((trained / EXTENSION).read_text())["short_blocks"] is True
    assert DraftConfig.from_folder(trained).format.short_blocks


def test_older_layout_keeps_loading_with_the_same_tensors(shipped_folder, tmp_path):
    """A draft that keeps the ids as a tensor and the settings in config.json (as drafts did before this
    layout) reads as the same draft."""
    old = tmp_path / "old"
    shutil.copytree(shipped_folder, old)
    raw = json.loads((old / "config.json").read_text())
    ext = json.loads((old / EXTENSION).read_text())
    (old / EXTENSION).unlink()
    raw["dflash_config"] |= {"short_blocks": True, draft_vocab.KEY: len(ext["draft_vocab"])}
    (old / "config.json").write_text(json.dumps(raw))
    t = load_file(str(old / "model.safetensors")) | {draft_vocab.TENSOR: torch.tensor(ext["draft_vocab"])}
    save_file(t, str(old / "model.safetensors"))
    assert read_config(old) == read_config(shipped_folder)
    a = read_tensors(old, DraftConfig.from_folder(old))
    b = read_tensors(shipped_folder, DraftConfig.from_folder(shipped_folder))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and export-draft --to hetero-sd rewrites it in the new layout, tensors unchanged
    assert main(["export-draft", str(old), "--to", "hetero-sd", "--out", str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / EXTENSION).read_text() == (shipped_folder / EXTENSION).read_text()
    assert (tmp_path / "new" / "training.json").is_file()
    c = load_file(str(tmp_path / "new" / "model.safetensors"))
    assert c.keys() == load_file(str(shipped_folder / "model.safetensors")).keys()


def test_a_setting_in_both_files_and_a_bad_extension_are_refused(tiny_draft, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(tiny_draft, both)
    (both / EXTENSION).write_text(json.dumps({"format": "hetero-sd draft extension 1", "short_blocks": True}))
    raw = json.loads((both / "config.json").read_text())
    raw["dflash_config"]["short_blocks"] = True
    (both / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="short_blocks given both in config.json and in hetero_sd.json"):
        DraftConfig.from_folder(both)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_draft, bad)
    (bad / EXTENSION).write_text(json.dumps({"format": "hetero-sd draft extension 1", "draft_vocab": [1, 2, 1]}))
    with pytest.raises(WeightsError, match="more than once"):
        read_tensors(bad, DraftConfig.from_folder(bad))
    (bad / EXTENSION).write_text(json.dumps({"format": "hetero-sd draft extension 1", "top_k": 3}))
    with pytest.raises(ConfigError, match="top_k not understood"):
        DraftConfig.from_folder(bad)


# --- z-lab's loader -------------------------------------------------------------------------------------

def test_zlab_loader_on_the_trained_draft_proposes_our_first_block(tiny_llama, trained):
    assert_same_proposals(*first_block(tiny_llama, trained, PROMPT))


@pytest.mark.slow
def test_zlab_loader_on_the_shipped_draft_proposes_our_first_block(default_folder, shipped_folder):
    from transformers import AutoTokenizer

    prompt = chat_ids(AutoTokenizer.from_pretrained(str(default_folder)),
                      "Write a Python function that checks whether a number is prime.")
    assert_same_proposals(*first_block(default_folder, shipped_folder, prompt))


def test_zlab_export_loads_clean_and_leaves_ours_behind(shipped_folder, tmp_path):
    out = tmp_path / "zlab"
    report = export_draft(shipped_folder, "zlab", out, say=None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert any("reduced head (8192 ids)" in line for line in report["left_behind"])
    _, info = zlab_load(out)
    assert_clean(info)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(shipped_folder / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_refuses_bad_requests(shipped_folder, tmp_path):
    with pytest.raises(ConfigError, match="not an export format"):
        export_draft(shipped_folder, "onnx", tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["export-draft", SHIPPED, "--to", "zlab", "--out", str(tmp_path / "full")]) == 2
    assert main(["export-draft", str(tmp_path / "nowhere"), "--to", "zlab", "--out", str(tmp_path / "y")]) == 2


# --- GGUF through llama.cpp's own converter ---------------------------------------------------------------

# our name -> llama.cpp's (its conversion/qwen.py DFlashModel over gguf-py's tensor map), layer i as {i}
GGUF_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight"}


def gguf_name(ours: str) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    return f"blk.{m[1]}.{GGUF_NAMES[m[2]]}" if m else GGUF_NAMES[ours]


@pytest.fixture(scope="module")
def gguf_export(shipped_folder, tmp_path_factory):
    if converter(say=None, fetch=False) is None:
        pytest.skip("llama.cpp's converter is not here: `hetero-sd export-draft cpu-trained --to gguf --out X.gguf` "
                    "fetches it (llama-cpp-python's sdist), or benchmarks/build_llama_cpp.sh keeps it")
    out = tmp_path_factory.mktemp("gguf") / "draft.gguf"
    assert main(["export-draft", SHIPPED, "--to", "gguf", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_gguf_export_holds_our_draft_as_llama_cpp_reads_it(gguf_export, shipped_folder):
    import gguf

    reader = gguf.GGUFReader(str(gguf_export))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    config = json.loads((shipped_folder / "config.json").read_text())
    assert field("general.architecture") == "dflash"
    assert field("dflash.block_size") == config["block_size"]
    assert field("tokenizer.ggml.mask_token_id") == config["dflash_config"]["mask_token_id"]
    # llama.cpp counts hidden states from the embeddings (index 0), z-lab from the first layer's output
    assert field("dflash.target_layers") == [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    ours = load_file(str(shipped_folder / "model.safetensors"))
    theirs = {t.name: t for t in reader.tensors}
    assert set(theirs) == {gguf_name(n) for n in ours}
    for name, t in ours.items():  # f32 holds bf16 exactly
        assert torch.equal(torch.from_numpy(theirs[gguf_name(name)].data.copy()).reshape(t.shape), t.float()), name


@pytest.mark.slow
def test_gguf_export_runs_in_llama_cpp_as_its_autoregressive_decoding(gguf_export, default_folder):
    from transformers import AutoTokenizer

    from hetero_sd.bench.peers_llama import build_dir, run_prompt
    from hetero_sd.loading.default_model import embedded_gguf

    spec, plain = build_dir() / "bin" / "llama-speculative-simple", build_dir() / "bin" / "llama-completion"
    if not (spec.is_file() and plain.is_file()):
        pytest.skip(f"no llama.cpp build at {build_dir()} (benchmarks/build_llama_cpp.sh, 15-40 min, never in tests)")
    rt = types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(default_folder)))
    ids = chat_ids(rt.tokenizer, "Write a Python function that adds two numbers.")
    common = ["-m", str(embedded_gguf()), "-t", "2", "-c", "512", "-b", "512", "--temp", "0", "--no-escape"]
    dflash = run_prompt([str(spec), *common, "-md", str(gguf_export), "--spec-type", "draft-dflash",
                         "--spec-draft-n-max", "7", "-td", "2"], rt, ids, 48, "llama.cpp-dflash")
    autoregressive = run_prompt([str(plain), *common, "-no-cnv", "--no-display-prompt", "--simple-io"], rt, ids, 48,
                                "llama.cpp")
    assert dflash["accepted"] > 0  # its draft's proposals were accepted: the GGUF is a working draft
    assert dflash["text"] == autoregressive["text"]


def test_gguf_export_needs_a_gguf_name(shipped_folder, tmp_path):
    with pytest.raises(Exception, match="does not end in .gguf"):
        export_draft(shipped_folder, "gguf", tmp_path / "draft.bin", say=None)


# --- MLX --------------------------------------------------------------------------------------------------

def test_mlx_export_loads_in_zlabs_mlx_reader(trained, tiny_llama, tmp_path, monkeypatch):
    """z-lab's dflash.model_mlx.load_draft (mx.load of every *.safetensors, strict load_weights): every tensor
    is one of its parameters and every parameter is given, with our values; bound to the target's embedding
    and head and run in float32 on the same context features, its first block is our runtime's."""
    zm = pytest.importorskip("dflash.model_mlx", reason="z-lab's MLX reader needs mlx (pip install mlx)")
    import numpy as np
    from mlx.utils import tree_flatten

    out = tmp_path / "mlx"
    export_draft(trained, "mlx", out, say=None)
    monkeypatch.setattr(zm, "snapshot_download", lambda repo, allow_patterns=None: repo)  # a local folder
    model = zm.load_draft(str(out))
    params = dict(tree_flatten(model.parameters()))
    ours = load_file(str(trained / "model.safetensors"))
    assert params.keys() == ours.keys()
    for name, t in ours.items():
        assert np.array_equal(np.array(params[name].astype(zm.mx.float32)), t.float().numpy()), name
    config = json.loads((out / "config.json").read_text())
    assert model.config.block_size == config["block_size"] and list(model.config.target_layer_ids) == \
        config["dflash_config"]["target_layer_ids"]

    from transformers import AutoModelForCausalLM

    mx, mnn = zm.mx, zm.nn
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    embed, head = hf.get_input_embeddings().weight.detach(), hf.lm_head.weight.detach()
    target = types.SimpleNamespace(embed_tokens=mnn.Embedding(*embed.shape), lm_head=mnn.Linear(
        head.shape[1], head.shape[0], bias=False))
    target.embed_tokens.weight, target.lm_head.weight = mx.array(embed.numpy()), mx.array(head.numpy())
    model.set_dtype(mx.float32)
    model.bind(target)
    theirs, ours = first_block(tiny_llama, trained, PROMPT)  # z-lab's torch model and our runtime
    with torch.inference_mode():
        out_hf = hf(torch.tensor([PROMPT]), output_hidden_states=True)
    features = torch.cat([out_hf.hidden_states[i + 1] for i in model.config.target_layer_ids], -1)
    anchor = int(out_hf.logits[0, -1].argmax())
    block = mx.array([[anchor] + [model.config.mask_token_id] * (model.config.block_size - 1)])
    mlx_logits = torch.from_numpy(np.array(model(block, mx.array(features.numpy()), model.make_cache(),
                                                 logits_start=1)[0]))
    assert_same_proposals(theirs, mlx_logits)
    assert_same_proposals(mlx_logits, ours)


# --- vLLM, SGLang, dflash-mlx: their loaders' names and keys ------------------------------------------------

ZLAB_NAME = (r"fc\.weight|hidden_norm\.weight|norm\.weight|layers\.\d+\.(self_attn\.(q|k|v|o)_proj|self_attn\.(q|k)_norm"
             r"|mlp\.(gate|up|down)_proj|input_layernorm|post_attention_layernorm)\.weight")


def vllm_parameters(layers: int) -> set[str]:
    """The parameters of vLLM's DFlashQwen3ForCausalLM without its optional embed_tokens / lm_head / d2t /
    mask_embedding (vllm/model_executor/models/qwen3_dflash.py, vllm-project/vllm 036a00d1:
    DFlashQwen3Model.__init__ and DFlashQwen3DecoderLayer: qkv_proj, o_proj, q_norm, k_norm, gate_up_proj,
    down_proj, the two layer norms; fc (use_aux_hidden_state), hidden_norm, norm)."""
    per_layer = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    return {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{p}" for i in range(layers) for p in per_layer}


def vllm_name(name: str) -> str:
    """DFlashQwen3ForCausalLM.load_weights: "model." before every name but lm_head / d2t / t2d, then
    hf_to_vllm_mapper's stacked renames (.q_proj/.k_proj/.v_proj -> .qkv_proj, .gate_proj/.up_proj -> .gate_up_proj).
    AutoWeightsLoader raises on a name that is no parameter."""
    name = name if "lm_head" in name or "d2t" in name else "model." + name
    for old, new in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                     (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        name = name.replace(old, new)
    return name


def sglang_parameters(layers: int) -> set[str]:
    """SGLang's DFlashDraftModel (python/sglang/srt/models/dflash.py, sgl-project/sglang 003b23d7): layers.*
    (DFlashAttention qkv_proj, o_proj, q_norm, k_norm; DFlashMLP gate_up_proj, down_proj; the two norms), norm,
    fc, hidden_norm; no embedding, no head."""
    return {n.removeprefix("model.") for n in vllm_parameters(layers)}


def sglang_name(name: str) -> str | None:
    """Its load_weights: stacked_params_mapping (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj) and
    resolve_param_name ("model." stripped or added); a name with no parameter is skipped silently."""
    for old, new in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                     ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
        if f".{old}." in name:
            name = name.replace(old, new)
            break
    name = name.removeprefix("model.")
    return name if name in sglang_parameters(99) else None


# config keys their parsers read (vLLM: qwen3_dflash.py; SGLang: python/sglang/srt/speculative/dflash_utils.py
# parse_dflash_draft_config, sgl-project/sglang 00731f0b); a key outside these is invisible to them
VLLM_DFLASH_KEYS = {"mask_token_id", "target_layer_ids", "use_swa", "swa_window_size", "causal",
                    "attention_sink_bias", "use_aux_hidden_state"}
SGLANG_DFLASH_KEYS = {"num_target_layers", "block_size", "conv_kernel_size", "conv_group_size", "selector_rank",
                      "selector_top_k", "output_multiplier", "final_logit_softcapping", "target_layer_ids",
                      "mask_token", "mask_token_id", "attention_sink_bias", "attention_value_scale", "projector_type"}
# dflash-mlx's DFlashDraftModelArgs fields without a default (bstnxbt/dflash-mlx dflash_mlx/model.py 0651f7cf):
# a config without one cannot build the model; its loader (dflash_mlx/runtime/loading.py) is mlx_lm's load_model
# over model*.safetensors with sanitize() the identity and strict load_weights
DFLASH_MLX_REQUIRED = {"model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                       "rms_norm_eps", "vocab_size", "num_key_value_heads", "max_position_embeddings", "rope_theta",
                       "head_dim", "tie_word_embeddings", "num_target_layers", "block_size"}


def check_against_the_field(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    names = set(load_file(str(folder / "model.safetensors")))
    layers = config["num_hidden_layers"]
    mapped = {vllm_name(n) for n in names}
    assert mapped == vllm_parameters(layers), ("vLLM", mapped ^ vllm_parameters(layers))
    assert {sglang_name(n) for n in names} == sglang_parameters(layers), "SGLang"
    assert all(re.fullmatch(ZLAB_NAME, n) for n in names), "dflash-mlx (z-lab's names, mlx_lm MLP names)"
    inside = set(config["dflash_config"])
    assert inside <= VLLM_DFLASH_KEYS & SGLANG_DFLASH_KEYS, inside - (VLLM_DFLASH_KEYS & SGLANG_DFLASH_KEYS)
    # vLLM sizes its head by a top-level draft_vocab_size (EAGLE-3's d2t offsets): ours must never be there
    assert "draft_vocab_size" not in config
    assert config["hidden_act"] == "silu" and set(config["layer_types"]) == {"full_attention"}  # non-causal in all
    assert not {"is_causal", "use_sliding_window"} & set(config)
    assert DFLASH_MLX_REQUIRED <= set(config), DFLASH_MLX_REQUIRED - set(config)
    assert all(0 <= i < config["num_target_layers"] for i in config["dflash_config"]["target_layer_ids"])


def test_shipped_and_trained_drafts_match_vllm_sglang_and_dflash_mlx_loaders(shipped_folder, trained):
    check_against_the_field(shipped_folder)
    check_against_the_field(trained)


def test_the_older_layout_does_not(shipped_folder, tmp_path):
    """The check can fail: the older layout's draft_vocab tensor is no vLLM parameter (its loader raises)."""
    old = tmp_path / "old"
    shutil.copytree(shipped_folder, old)
    t = load_file(str(old / "model.safetensors")) | {draft_vocab.TENSOR: torch.arange(4)}
    save_file(t, str(old / "model.safetensors"))
    with pytest.raises(AssertionError, match="vLLM"):
        check_against_the_field(old)


def test_export_draft_command_prints_its_report(tmp_path, capsys, tiny_draft):
    assert main(["export-draft", str(tiny_draft), "--to", "mlx", "--out", str(tmp_path / "m")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "mlx" and "left_behind" not in report


def test_a_draft_loaded_from_its_folder_alone_applies_the_extension(tiny_llama, tiny_draft, tmp_path):
    """The evaluator (train/evaluate.py, eval_heldout.py) loads a draft from its folder, not through the
    loader: the reduced head's ids in hetero_sd.json reach it too."""
    from hetero_sd.backends.torch_backend import load_draft
    from hetero_sd.models.draft_format import write_folder

    raw = read_config(tiny_draft)
    tensors = read_tensors(tiny_draft, DraftConfig.from_folder(tiny_draft))
    raw["dflash_config"][draft_vocab.KEY] = 3
    write_folder(tmp_path / "r", raw, tensors | {draft_vocab.TENSOR: torch.tensor([1, 5, 9])})
    assert draft_vocab.TENSOR not in load_file(str(tmp_path / "r" / "model.safetensors"))
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft))
    d = load_draft(tmp_path / "r", DraftConfig.from_folder(tmp_path / "r"), rt.target, "cpu", torch.float32, 3)
    d.add_context(torch.randn(4, d.fc.shape[0]))
    logits = d.propose(5)
    outside = torch.ones(logits.shape[1], dtype=torch.bool)
    outside[[1, 5, 9]] = False
    assert (logits[:, outside] == draft_vocab.FLOOR).all() and (logits[:, ~outside] > draft_vocab.FLOOR).all()
