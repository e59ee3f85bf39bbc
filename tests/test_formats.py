"""Every draft format z-lab's reference runs, against the reference itself (the `dflash` package):
checkpoints made with its own classes, loaded unchanged from safetensors, must draft what it drafts
and generate what it generates. And whatever the runtime would not apply is an error naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hetero_sd
import hetero_sd.backends.torch_backend.dflash2 as dflash2
import hetero_sd.backends.torch_backend.draft as torch_draft
from hetero_sd.cli import main
from hetero_sd.models.config import DraftConfig
from hetero_sd.errors import ConfigError, WeightsError
from hetero_sd.backends.placement import draft_backend

from . import reference_dflash as ref
from .conftest import make_tiny_target

PROMPT, MAX_NEW = [5, 9, 7, 2, 4, 6], 40
SLIDING = dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
SCALES = dict(input_embedding_scale=1.5, output_multiplier=0.8, final_logit_softcapping=3.0)
FORMATS = {
    "dflash": dict(),
    "dflash-sliding-scaled": dict(config=SLIDING, dflash_config=SCALES),
    "dflash2": dict(dflash2=True),  # codebooks named as published (no `.weight`)
    "dflash2-sliding-noncausal": dict(dflash2=True, config=dict(SLIDING, is_causal=False), seed=4),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 12-token vocabulary, so that random drafts get some of their tokens accepted."""
    return make_tiny_target(tmp_path_factory.mktemp("t12"), "qwen3", vocab_size=12, seed=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def hf_target(target):
    return ref.hf_target(target)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """name -> (reference model, folder)."""
    out = {}
    for name, kw in FORMATS.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = ref.make_reference_draft(folder, vocab=12, **kw), folder
    return out


@pytest.mark.parametrize("name", FORMATS)
def test_first_block_matches_the_reference(name, drafts, target, hf_target):
    model, folder = drafts[name]
    tokens, logits = ref.first_block(model, hf_target, PROMPT)
    step = hetero_sd.load(str(target), str(folder), draft_dtype="float32").draft_step(PROMPT)
    assert step.tokens == tokens
    # float32 with other reduction orders (our kernels vs transformers', 1 or 2 threads): up to ~1.3e-5 on
    # logits of magnitude ~4 (measured); a wrong mask, rope or norm moves them by 1e-2 and more.
    torch.testing.assert_close(torch.from_numpy(step.logits), logits, rtol=1e-4, atol=5e-5)
    if name.startswith("dflash2"):  # the selector changed the path: it is not argmax in disguise
        assert tokens != logits.argmax(-1).tolist()


@pytest.mark.parametrize("name", FORMATS)
def test_greedy_generation_matches_the_reference(name, drafts, target, hf_target, monkeypatch):
    model, folder = drafts[name]
    tokens, acceptance = ref.generate(model, hf_target, PROMPT, MAX_NEW, monkeypatch)
    # the reference proposes the draft's tokens alone: so does this run (lookup=0)
    rt = hetero_sd.load(str(target), str(folder), block_size="fixed", draft_dtype="float32", lookup=0)
    spec = rt.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert spec.token_ids == tokens == rt.generate(PROMPT, max_new_tokens=MAX_NEW, speculative=False).token_ids
    ours = [a + 1 for a in spec.stats.accepted_per_step]
    assert ours[:len(acceptance)] == acceptance
    assert max(acceptance) > 1  # some drafts were accepted: the comparison covers the accepting path


@pytest.mark.parametrize("name", ["dflash2", "dflash-sliding-scaled"])
def test_every_schedule_and_block_size_stays_lossless(name, drafts, target):
    """Pre-drafts at a lagged context (overlap), smaller blocks (fixed or the controller), two requests at once."""
    rt = hetero_sd.load(str(target), str(drafts[name][1]), block_size="fixed")
    prompts = [PROMPT, [3, 1, 4, 1, 5]]
    base = [rt.generate(p, max_new_tokens=MAX_NEW, speculative=False).token_ids for p in prompts]
    for kw in (dict(schedule="overlap"), dict(block="auto"), dict(block=3)):
        assert [rt.generate(p, max_new_tokens=MAX_NEW, **kw).token_ids for p in prompts] == base, kw
    assert [g.token_ids for g in rt.generate_many(prompts, max_new_tokens=MAX_NEW)] == base


@pytest.mark.parametrize("name,piece", [("dflash-sliding-scaled", "masks"), ("dflash2", "convolution"),
                                        ("dflash2", "codebooks")])
def test_the_parity_check_catches_a_missing_piece(name, piece, drafts, target, hf_target, monkeypatch):
    """Mutation check: drop one piece of the format and the first block must stop matching."""
    model, folder = drafts[name]
    tokens, logits = ref.first_block(model, hf_target, PROMPT)
    if piece == "masks":
        monkeypatch.setattr(torch_draft, "block_masks", lambda attention, *a: [None] * len(attention))
    elif piece == "convolution":
        monkeypatch.setattr(dflash2.DynamicConv, "prepare", lambda self, x: (x, None))
        monkeypatch.setattr(dflash2.DynamicConv, "finish", lambda self, x, d: x)
    else:
        monkeypatch.setattr(dflash2.Selector, "block", lambda self, hidden, lg, anchor: lg)
    step = hetero_sd.load(str(target), str(folder), draft_dtype="float32").draft_step(PROMPT)
    same_logits = torch.allclose(torch.from_numpy(step.logits), logits, rtol=1e-4, atol=1e-5)
    assert not (same_logits and step.tokens == tokens)


def test_the_format_is_named_in_stats_and_bench_json(drafts, target, tmp_path, capsys):
    folder = drafts["dflash2"][1]
    rt = hetero_sd.load(str(target), str(folder), block_size="fixed", draft_dtype="float32")
    assert rt.info["draft_format"] == "dflash2 (top-5 selector, conv kernel 3)"
    assert rt.generate(PROMPT, max_new_tokens=4).stats.draft_format == rt.info["draft_format"]
    assert rt.generate(PROMPT, max_new_tokens=4, speculative=False).stats.draft_format is None
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5 t6 t7"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(target), "--draft", str(folder), "--prompts", str(prompts),
                 "--limit", "1", "--max-new-tokens", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["models"]["draft_format"] == "dflash2 (top-5 selector, conv kernel 3)" and res["lossless"]
    assert "(draft: dflash2 (top-5" in " ".join(capsys.readouterr().out.split())  # the title may wrap
    sliding = hetero_sd.load(str(target), str(drafts["dflash-sliding-scaled"][1]), block_size="fixed")
    assert sliding.info["draft_format"] == ("dflash; sliding-window attention (window 4); causal attention in the "
                                            "block; input_embedding_scale 1.5; output_multiplier 0.8; "
                                            "final_logit_softcapping 3")


# --- what the runtime does not apply is an error naming it ---------------------------------------------

def edited(src, dst, config=None, tensors=None):
    """A copy of a draft folder with its config.json and/or tensors edited."""
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def relabel_as_dflash(raw):
    """A DFlash2 checkpoint relabelled as plain DFlash (what a runtime that knows only DFlash reads)."""
    raw["architectures"] = ["DFlashDraftModel"]
    for k in ref.DFLASH2:
        raw["dflash_config"].pop(k)


BROKEN = {
    "architecture": (dict(config=lambda raw: raw.update(architectures=["EagleDraftModel"])),
                     ConfigError, "draft architecture EagleDraftModel is not one hetero-sd runs"),
    "top-level key": (dict(config=lambda raw: raw.update(attn_logit_softcapping=50.0)),
                      ConfigError, r"config key\(s\) attn_logit_softcapping not understood"),
    "dflash_config key": (dict(config=lambda raw: raw["dflash_config"].update(num_diffusion_steps=2)),
                          ConfigError, r"dflash_config.num_diffusion_steps not understood"),
    "layer type": (dict(config=lambda raw: raw.update(layer_types=["chunked_attention", "full_attention"])),
                   ConfigError, "layer_types.*chunked_attention"),
    "activation": (dict(config=lambda raw: raw.update(hidden_act="gelu")), ConfigError, "hidden_act 'gelu'"),
    "DFlash2 key on DFlash": (dict(config=lambda raw: raw["dflash_config"].update(selector_top_k=4)),
                              ConfigError, "DFlash2 keys in a DFlashDraftModel config"),
    "extra tensor": (dict(tensors=lambda t: t.update({"layers.1.self_attn.sinks": torch.zeros(4)})),
                     WeightsError, r"tensor\(s\) layers.1.self_attn.sinks not used by a dflash draft"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_what_the_runtime_would_not_apply_is_an_error(case, drafts, target, tmp_path, capsys):
    edits, error, message = BROKEN[case]
    bad = edited(drafts["dflash"][1], tmp_path / "bad", **edits)
    with pytest.raises(error, match=message):
        hetero_sd.load(str(target), str(bad))
    assert main(["generate", "t5 t6", "--target", str(target), "--draft", str(bad), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "fix:" in err and len(err.strip().splitlines()) <= 4


def test_a_dflash2_checkpoint_read_as_dflash_names_the_unused_tensors(drafts, target, tmp_path):
    bad = edited(drafts["dflash2"][1], tmp_path / "bad", config=relabel_as_dflash)
    with pytest.raises(WeightsError, match=r"attention_conv.base_kernel.* not used by a dflash draft"):
        hetero_sd.load(str(target), str(bad))


def test_a_draft_is_qwen3_layers_whatever_its_model_type(drafts, target, tmp_path):
    """As in the reference (its draft class is a Qwen3 model): q/k norms, no bias."""
    folder = drafts["dflash"][1]
    llama = edited(folder, tmp_path / "d", config=lambda raw: raw.update(model_type="llama"))
    a = hetero_sd.load(str(target), str(folder)).draft_step(PROMPT)
    b = hetero_sd.load(str(target), str(llama)).draft_step(PROMPT)
    assert a.tokens == b.tokens and (a.logits == b.logits).all()


def test_published_and_save_pretrained_codebook_names_both_load(drafts, target, tmp_path):
    model, folder = drafts["dflash2"]
    renamed = edited(folder, tmp_path / "d", tensors=lambda t: t.update(
        {k + ".weight": t.pop(k) for k in [k for k in t if k.endswith("codebook")]}))
    a = hetero_sd.load(str(target), str(folder)).draft_step(PROMPT)
    b = hetero_sd.load(str(target), str(renamed)).draft_step(PROMPT)
    assert a.tokens == b.tokens and (a.logits == b.logits).all()


@pytest.mark.parametrize("name", ["dflash2", "dflash-sliding-scaled"])
def test_mlx_and_the_neural_engine_refuse_what_they_do_not_run(name, drafts, target):
    folder = drafts[name][1]
    what = "DFlash2" if name == "dflash2" else "sliding-window attention"
    with pytest.raises(ConfigError, match=f"Neural Engine graph.*{what}"):
        hetero_sd.load(str(target), str(folder), draft_device="ane-sim")
    with pytest.raises(ConfigError, match=f"the MLX backend does not run drafts with .*{what}"):
        draft_backend(folder, DraftConfig.from_folder(folder), None, "mlx", None, ref.MASK, {}, [])
