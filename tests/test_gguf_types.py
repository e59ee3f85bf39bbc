"""A GGUF with K-quant tensors loads and decodes; the dequantized types are announced with their memory,
and a GGUF that would not fit is refused before its conversion, naming the memory it needs.

gguf-py (0.19) quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 in Python but not the K-quants (it only dequantizes
them), so the test packs Q6_K blocks itself, checked against gguf-py's own Q6_K decoder. The file is the
embedded SmolLM2 GGUF cut to 2 layers, with every ffn_down (rows of 1536 = 6 x 256) as Q6_K and the rest
as it was (Q4_1, Q8_0, F32): a mixture like llama.cpp's Q4_K_M files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import hetero_sd
from hetero_sd.errors import ConfigError
from hetero_sd.loading import gguf_memory
from hetero_sd.loading.default_model import converted_path

QK = 256
pytestmark = pytest.mark.slow  # reads the embedded SmolLM2 GGUF


def q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q6_K blocks [rows, cols / 256 * 210] as llama.cpp lays
    them out: ql (low nibbles), qh (high 2 bits), 16 int8 sub-block scales, fp16 d."""
    rows = x.shape[0]
    blocks = x.reshape(-1, QK).astype(np.float32)
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31.0  # q - 32 spans -32..31
    d = scale.max(axis=1) / 127.0
    d16 = d.astype(np.float16)
    d_used = d16.astype(np.float32)
    scales = np.where(d_used[:, None] > 0, np.round(scale / np.where(d_used > 0, d_used, 1)[:, None]), 0)
    scales = np.clip(scales, -128, 127).astype(np.int8)
    step = d_used[:, None] * scales.astype(np.float32)
    q = np.where(step[:, :, None] != 0, np.round(sub / np.where(step == 0, 1, step)[:, :, None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, QK)
    lo, hi = q & 0x0F, q >> 4
    ql = np.empty((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    for h in range(2):  # the inverse of gguf.quants.Q6_K.dequantize_blocks' unpacking
        ql[:, h * 64:(h + 1) * 64] = lo[:, h * 128:h * 128 + 64] | (lo[:, h * 128 + 64:(h + 1) * 128] << 4)
        for t in range(4):
            qh[:, h * 32:(h + 1) * 32] |= hi[:, h * 128 + t * 32:h * 128 + (t + 1) * 32] << (2 * t)
    out = np.concatenate([ql, qh, scales.view(np.uint8), d16.reshape(-1, 1).view(np.uint8)], axis=1)
    return out.reshape(rows, -1)


def test_q6_k_packing_matches_gguf_py():
    from gguf import GGMLQuantizationType, quants

    x = np.random.default_rng(0).normal(0, 0.05, (4, 512)).astype(np.float32)
    back = quants.dequantize(q6_k_blocks(x), GGMLQuantizationType.Q6_K)
    assert back.shape == x.shape
    assert np.abs(back - x).max() < 0.03 * np.abs(x).max()


def write_kquant_gguf(path: Path, layers: int = 2) -> Path:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    from hetero_sd.loading.default_model import embedded_gguf

    reader = GGUFReader(str(embedded_gguf()))
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        writer.add_key_value(name, value, kind, field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        if "ffn_down" in t.name:
            dense = quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, q6_k_blocks(dense), raw_dtype=GGMLQuantizationType.Q6_K)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def kquant(tmp_path_factory) -> Path:
    return write_kquant_gguf(tmp_path_factory.mktemp("kq") / "SmolLM2-2L-Q6_K-mix.gguf")


def test_the_file_holds_k_quants(kquant):
    from collections import Counter

    from gguf import GGUFReader

    summary = gguf_memory.summarize(kquant)
    elements, stored = Counter(), Counter()  # the header walk agrees with gguf-py's reader
    for t in GGUFReader(str(kquant)).tensors:
        elements[t.tensor_type.name] += int(t.n_elements)
        stored[t.tensor_type.name] += int(t.n_bytes)
    assert summary.elements == dict(elements) and summary.stored == dict(stored) and summary.arch == "llama"
    assert summary.types["Q6_K"] == 2 and summary.types["Q4_1"] > 0
    need, dequantized = gguf_memory.plan(summary, "cpu", "float32")
    assert dequantized == ["Q6_K"]  # Q4_1 / Q8_0 stay blocks on the fast CPU path
    assert need == summary.elements["Q6_K"] * 4 + summary.stored["Q4_1"] + summary.stored["Q8_0"] \
        + summary.elements["F32"] * 4
    _, on_gpu = gguf_memory.plan(summary, "cuda", "bfloat16")
    assert on_gpu == ["Q4_1", "Q6_K", "Q8_0"]  # no block kernels there: everything dequantized


def test_a_k_quant_gguf_loads_decodes_and_is_announced(kquant):
    from gguf import GGMLQuantizationType, GGUFReader, quants
    from safetensors.torch import load_file

    rt = hetero_sd.load(str(kquant), "random:1", block_size=4)
    assert any("2 Q6_K tensors have no kernel here and are dequantized to float32" in n for n in rt.info["notes"])
    # the converted folder holds gguf-py's own dequantization of our Q6_K blocks
    down = next(t for t in GGUFReader(str(kquant)).tensors if t.name == "blk.0.ffn_down.weight")
    expected = quants.dequantize(down.data, GGMLQuantizationType.Q6_K)
    weights = load_file(str(Path(rt.info["target"]) / "model.safetensors"))
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(expected))
    prompt = "Name three colours."
    plain = rt.generate(prompt, max_new_tokens=10, speculative=False)
    spec = rt.generate(prompt, max_new_tokens=10)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 0 and spec.stats.num_drafts > 0
    assert any("Q6_K" in n for n in spec.stats.notes)  # announced in every generation's stats too


def test_a_gguf_that_does_not_fit_is_refused_before_conversion(kquant, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"needs about 0\.\d GB as float32 weights on cpu \(Q6_K dequantized; "
                                          r"the file is 0\.\d GB\), but cpu has 0\.0 GB free"):
        gguf_memory.check_gguf(kquant, "cpu", "float32", [], free=1000)
    monkeypatch.setattr(gguf_memory, "available_bytes", lambda device: 1000)
    fresh = Path(str(kquant).replace(".gguf", "-copy.gguf"))
    fresh.write_bytes(kquant.read_bytes())
    with pytest.raises(ConfigError, match="GB free"):
        hetero_sd.load(str(fresh), None)
    assert not converted_path(fresh).exists()  # refused before converting
