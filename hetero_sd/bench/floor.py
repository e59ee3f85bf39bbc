"""The physical floor of one decode step: every weight (and the KV cache so far) is read once per
token, so a step cannot take less than bytes / memory bandwidth. Bandwidth is measured here, on the memory the
target's weights are in (hetero_sd.decoding.costs.bandwidth_gb_s: the host's reads, or a GPU's own copies)."""

from __future__ import annotations

from hetero_sd.decoding.costs import bandwidth_gb_s, memory_device, model_sizes


def target_bytes(target) -> tuple[int, int]:
    """(bytes of weights read per decode step, bytes of KV cache per position) for a target that exposes
    its weights (TargetBackend.weights). A target multiplying GGUF blocks (the CPU default of a GGUF) reads
    its matrices as those blocks (ModelWeights.read_bytes), not as the float32 tensors it also keeps."""
    w = target.weights()
    matrices, _, _ = model_sizes(w)  # the head and every layer's matrices, as stored or as GGUF blocks
    weights = matrices + w.norm.nbytes + w.embed[0].nbytes  # one embedding row
    for layer in w.layers:
        weights += sum(t.nbytes for t in (layer.in_norm, layer.post_norm) if t is not None)
    return weights, w.kv_bytes_per_position


def floor_report(target, context: int, systems: dict[str, float], gguf_bytes: int | None = None) -> dict:
    """systems: name -> measured tokens/s. The floor is computed for the bytes our target reads (its GGUF
    blocks, or its float weights), and for the GGUF file's size where a GGUF peer ran, since each system
    reads its own weights."""
    bandwidth = bandwidth_gb_s(memory_device(target))
    weights, kv = target_bytes(target)
    step_bytes = weights + kv * context
    floor_tps = bandwidth * 1e9 / step_bytes
    out = {"read_bandwidth_gb_s": bandwidth, "weight_bytes": weights, "kv_bytes_per_position": kv,
           "context": context, "step_bytes": step_bytes, "floor_tokens_per_s": floor_tps,
           "fraction_of_floor": {name: tps / floor_tps for name, tps in systems.items()
                                 if name != "llama.cpp"}}
    if gguf_bytes and "llama.cpp" in systems:
        gguf_floor = bandwidth * 1e9 / (gguf_bytes + kv * context)
        out.update(gguf_bytes=gguf_bytes, gguf_floor_tokens_per_s=gguf_floor)
        out["fraction_of_floor"]["llama.cpp"] = systems["llama.cpp"] / gguf_floor
    return out
