"""The GGUF layout of a Llama/Qwen model's Q4_1 / Q8_0 tensors: block sizes, the tensors' names, their rows
read from the file (memory-mapped) in the converted model's order, and their dequantized values as the
converter computes them (gguf-py's own `gguf.quants.dequantize`). Backend-neutral: the torch backend's
GGUF kernels (quant.py, quant8.py) and the tests read it."""

from __future__ import annotations

import numpy as np
import torch

Q4_1, Q8_0 = "Q4_1", "Q8_0"
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


def dequantize(kind: str, rows: np.ndarray) -> torch.Tensor:
    """GGUF rows [N, K/32 * block bytes] -> float32 [N, K], exactly as the converter computed them
    (gguf-py: d*q + m and d*q in float32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(np.asarray(rows), GGMLQuantizationType[kind])))


LAYER_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


GGML_TYPES = {3: Q4_1, 8: Q8_0}  # ggml_type ids of the block formats the kernel multiplies


def gguf_tensors(path) -> dict[str, tuple[str, np.ndarray]]:
    """The Q4_1/Q8_0 tensors of a GGUF (v2/v3) as (kind, rows [out, bytes], memory-mapped): a header walk
    that skips the metadata (gguf.GGUFReader decodes every tokenizer string: seconds)."""
    import struct

    data = np.memmap(path, dtype=np.uint8, mode="r")
    at = 0

    def take(fmt):
        nonlocal at
        vals = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string():
        nonlocal at
        n = take("Q")
        at += n
        return bytes(data[at - n:at]).decode("utf-8", "replace")

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(kind):
        nonlocal at
        if kind in sizes:
            at += sizes[kind]
        elif kind == 8:
            n = take("Q")  # (not `at += take(...)`: that adds to the offset read before the call)
            at += n
        elif kind == 9:
            item, count = take("I"), take("Q")
            if item in sizes:
                at += sizes[item] * count
            else:
                for _ in range(count):
                    skip(item)
        else:
            raise ValueError(f"unknown GGUF metadata type {kind}")

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path} is not a GGUF v2+ file")
    alignment = 32
    for _ in range(n_kv):
        key, kind = string(), take("I")
        if key == "general.alignment" and kind == 4:
            alignment = take("I")
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name, dims = string(), take("I")
        shape = [take("Q") for _ in range(dims)]
        infos.append((name, shape, take("I"), take("Q")))
    start = -(-at // alignment) * alignment
    out = {}
    for name, shape, kind, offset in infos:
        if kind in GGML_TYPES and len(shape) == 2 and shape[0] % 32 == 0:
            row = shape[0] // 32 * BLOCK_BYTES[GGML_TYPES[kind]]
            out[name] = (GGML_TYPES[kind], data[start + offset:start + offset + row * shape[1]].reshape(shape[1], row))
    return out


def gguf_rows(path, cfg) -> dict[str, tuple[str, np.ndarray]]:
    """The GGUF's Q4_1/Q8_0 tensors as (kind, rows [out, bytes]) under our names ('embed', 'lm_head',
    (layer, 'q_proj'), ...), rows in the converted model's order: llama.cpp stores a Llama's q/k rows
    permuted, and transformers undoes that when converting (its _reverse_permute_weights)."""
    found = gguf_tensors(path)
    wanted = {"embed": "token_embd.weight", "lm_head": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        wanted.update({(i, key): f"blk.{i}.{name}.weight" for key, name in LAYER_GGUF.items()})
    out = {}
    for key, name in wanted.items():
        if name not in found:
            continue
        kind, rows = found[name]
        if cfg.model_type == "llama" and isinstance(key, tuple) and key[1] in ("q_proj", "k_proj"):
            heads = cfg.num_attention_heads if key[1] == "q_proj" else cfg.num_key_value_heads
            order = np.arange(rows.shape[0]).reshape(heads, rows.shape[0] // heads // 2, 2).swapaxes(2, 1).reshape(-1)
            rows = rows[order]
        out[key] = (kind, rows)
    return out
