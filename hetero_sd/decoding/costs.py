"""The cost probe: what one decode step, one verify of k tokens and one draft block cost on
this machine, in this process, with these weights. A speculative step pays off only when
verify(k) + draft(b) is small next to tau * decode, so the scheduler's block policy reads these numbers,
and `hetero-sd bench --costs` prints them against the compute/bandwidth floor of each call.

Every figure is a median over `repeats` timed calls after one untimed warm-up call, on top of a context of
~`context` positions (filled with a fixed token pattern when the caches hold less). The backends' caches
are cropped back to where they were afterwards."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable

import torch

from hetero_sd.devices import capability
from hetero_sd.backends.base import (DraftBackend, ModelWeights, TargetBackend, forward_matrices, synchronize,
                                     weights_of)


@dataclass
class Costs:
    decode_s: float                 # one autoregressive step: target forward of 1 token (last_only logits)
    verify_s: dict[int, float]      # k -> target forward of k tokens on top of the context (all logits + features)
    draft_s: dict[int, float]       # block size b -> one draft propose of size b (after add_context)
    peak_gflops: float | None = None  # the dense matmul's (torch, the compute dtype)
    kernel_peak_gops: dict = field(default_factory=dict)  # {"target"/"draft": ops/s / 1e9} of a model's own
    #                                                         int8-row kernel, where it multiplies by one (its floor)
    bandwidth_gbs: float | None = None
    cpu: str = ""                   # lscpu model name + capability
    device: str = ""                # the target's accelerator by name (e.g. "NVIDIA H200"); "" on the CPU
    dtype: str = ""
    context: int = 0                # positions in the caches while measuring
    threads: int = 0                # torch intra-op threads
    floors_s: dict = field(default_factory=dict)  # {"decode": s, "verify": {k: s}, "draft": {b: s}} (machine=True)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["verify_s"] = {str(k): v for k, v in self.verify_s.items()}
        d["draft_s"] = {str(b): v for b, v in self.draft_s.items()}
        if self.floors_s:
            d["floors_s"] = {"decode": self.floors_s["decode"],
                             "verify": {str(k): v for k, v in self.floors_s["verify"].items()},
                             "draft": {str(b): v for b, v in self.floors_s["draft"].items()}}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Costs":
        d = dict(d.get("costs", d))  # a whole bench JSON or its `costs` object
        d["verify_s"] = {int(k): float(v) for k, v in d["verify_s"].items()}
        d["draft_s"] = {int(b): float(v) for b, v in d.get("draft_s", {}).items()}
        if d.get("floors_s"):
            f = d["floors_s"]
            d["floors_s"] = {"decode": f["decode"], "verify": {int(k): v for k, v in f["verify"].items()},
                             "draft": {int(b): v for b, v in f["draft"].items()}}
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})

    def ratios(self) -> dict:
        """Each cost as a multiple of the decode step: what the block policy compares against tau."""
        return {"verify": {k: v / self.decode_s for k, v in self.verify_s.items()},
                "draft": {b: v / self.decode_s for b, v in self.draft_s.items()}}


def cpu_model() -> str:
    """lscpu's model name (/proc/cpuinfo), or what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_name() -> str:
    """The model name and torch's CPU capability: every figure states the CPU it came from."""
    return f"{cpu_model()} ({capability()})"


MIN_SECONDS = 0.25  # per measured call: a 7 ms step timed 5 times was at the mercy of one stall of the VM


def interleaved_medians(fns: dict, repeats: int, sync: Callable[[], None]) -> dict:
    """The median seconds of each call, of at least `repeats` timed calls and at least MIN_SECONDS of the slowest,
    after 3 untimed warm-up calls (caches, lazily built tables, the allocator, the thread pool waking up); taken
    in rounds, each call once per round: a machine whose
    speed drifts between seconds (a VM's neighbours) moves every call's time alike, so their ratios, which
    the controller decides on, stay right. Timed one after another, a slow second made verify-4 read 1.2x
    and verify-2 1.27 decode steps where quieter probes read 1.1x and 1.04-1.09 (2-core Zen 5)."""
    each = {}
    for name, fn in fns.items():
        for _ in range(3):  # warm-up; the last call alone sizes the rounds (the first may capture a CUDA graph)
            began = time.perf_counter()
            fn()
            sync()
        each[name] = time.perf_counter() - began
    rounds = min(max(repeats, int(MIN_SECONDS / max(max(each.values(), default=0.0), 1e-6))), 100)
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


FILL_TOKENS = (504, 2056, 314, 1431, 288, 3012, 30, 216)  # any in-vocabulary ids: only the shapes matter


def fill_ids(n: int, vocab: int) -> list[int]:
    return [FILL_TOKENS[i % len(FILL_TOKENS)] % vocab for i in range(n)]


def fill_context(target: TargetBackend, draft: DraftBackend | None, context: int) -> None:
    """Bring both caches to ~`context` positions (the draft's context features come from the target)."""
    need = context - target.length
    if need <= 0:
        return
    out = target.forward(fill_ids(need, target.config.vocab_size), last_only=True, features=draft is not None)
    if draft is not None and out.features is not None:
        draft.crop(target.length - need)
        draft.add_context(out.features)


def measure_costs(target: TargetBackend, draft: DraftBackend | None, *, context: int = 512,
                  ks=(1, 2, 4, 8, 16), blocks=(2, 4, 8, 16), repeats: int = 5, machine: bool = False) -> Costs:
    """Median seconds of a decode step, a verify of k tokens and a draft block of size b (see module doc).
    machine=True also measures the matmul peak and read bandwidth and computes each call's floor."""
    target_at = target.length
    draft_at = draft.context_length if draft is not None else 0
    try:
        fill_context(target, draft, context)
        base = target.length
        costs = Costs(decode_s=0.0, verify_s={}, draft_s={}, cpu=cpu_name(), dtype=backend_dtype(target),
                      context=base, threads=torch.get_num_threads(), device=accelerator_name(device_of(target)))
        vocab = target.config.vocab_size
        calls = {("decode", 1): partial(step, target, base, fill_ids(1, vocab), False)}
        calls |= {("verify", k): partial(step, target, base, fill_ids(k, vocab), True) for k in ks}
        times = interleaved_medians(calls, repeats, target.synchronize)
        costs.decode_s = times["decode", 1]
        costs.verify_s = {k: times["verify", k] for k in ks}
        if draft is not None:
            for b in blocks:
                if b > draft.block_size:
                    costs.notes.append(f"draft block {b} skipped: the draft's block size is {draft.block_size}")
            sizes = [b for b in blocks if b <= draft.block_size]
            costs.draft_s = interleaved_medians({b: partial(draft.propose, fill_ids(1, vocab)[0], size=b) for b in sizes},
                                                repeats, draft.synchronize)
    finally:
        target.crop(target_at)
        if draft is not None:
            draft.crop(draft_at)
    if machine:
        add_machine(costs, target, draft)
    return costs


def step(target: TargetBackend, base: int, ids: list[int], features: bool):
    out = target.forward(ids, features=features)
    target.crop(base)
    return out


def backend_dtype(backend) -> str:
    dtype = getattr(backend, "dtype", None)
    mode = getattr(backend, "mode", None)  # a named numerics mode (e.g. bf16 weights), where the backend has one
    name = str(dtype).removeprefix("torch.") if dtype is not None else "unknown"
    return f"{name} ({mode})" if mode and mode != name else name


def device_of(backend) -> str:
    return str(getattr(backend, "device", "cpu"))


def device_kind(device: str) -> str:
    """"cuda" of "cuda:0"; a device torch does not know (mlx, ane-sim) as it is named."""
    try:
        return torch.device(device).type
    except RuntimeError:
        return device


def accelerator_name(device: str) -> str:
    """The accelerator a device string names ("" for the CPU): a floor is the hardware's, so it says which."""
    kind = device_kind(device)
    if kind == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return {"cpu": "", "mps": "Apple GPU (MPS)", "mlx": "MLX"}.get(kind, kind)


def device_sync(device: str) -> Callable[[], None]:
    return partial(synchronize, device)


def peak_gflops(dtype: torch.dtype = torch.float32, n: int | None = None, repeats: int = 5,
                device: str = "cpu") -> float:
    """The practical matmul peak on `device`: best of a few n^3 products (the process's threads on the CPU;
    on a GPU large enough products to fill it, timed to the device's completion; MLX's through MLX)."""
    if device_kind(device) == "mlx":
        import mlx.core as mx

        from hetero_sd.backends.mlx_backend import probe

        return probe.peak_gflops(getattr(mx, str(dtype).removeprefix("torch.")), n, repeats)
    on_cpu = device_kind(device) == "cpu"
    n = n or (1024 if on_cpu else 8192)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = device_sync(device)
    a @ b
    sync()
    best = min(timed(lambda: (a @ b, sync())) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


BUFFER_MB = 512


def read_bandwidth_gb_s(repeats: int = 5, buffer_mb: int = BUFFER_MB) -> float:
    """Memory read bandwidth with the process's torch threads: the best of a few full reads of a buffer
    much larger than the caches."""
    x = torch.ones(buffer_mb * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - began)
    return x.nbytes / best / 1e9


def device_bandwidth_gb_s(device: str, repeats: int = 5, buffer_mb: int = 1024) -> float:
    """An accelerator's memory bandwidth: the best of a few device-to-device copies of a buffer far larger than
    its caches, counting the bytes read and written."""
    x = torch.ones(buffer_mb * 2**20 // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    sync = device_sync(device)
    y.copy_(x)
    sync()
    best = min(timed(lambda: (y.copy_(x), sync())) for _ in range(repeats))
    return 2 * x.nbytes / best / 1e9


def memory_device(backend) -> str:
    """The device whose memory a backend's weights are read from, as the probes measure it: its own for
    cpu/cuda/mps and MLX (measured through MLX), the host's for the Neural Engine's emulation."""
    device = device_of(backend)
    return device if device_kind(device) in ("cpu", "cuda", "mps", "mlx") else "cpu"


def bandwidth_gb_s(device: str) -> float:
    """Memory bandwidth where `device` keeps its weights: host reads for the CPU, device copies elsewhere (MLX's
    through MLX)."""
    kind = device_kind(device)
    if kind == "mlx":
        from hetero_sd.backends.mlx_backend import probe

        return probe.bandwidth_gb_s()
    return read_bandwidth_gb_s() if kind == "cpu" else device_bandwidth_gb_s(device)


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def add_machine(costs: Costs, target, draft) -> None:
    """Peak, bandwidth and, for torch backends, each call's floor: max(bytes / bandwidth, flops / peak), the
    peak being the model's own int8-row kernel's where it has one (own_peak)."""
    dtype = torch_dtype(getattr(target, "dtype", torch.float32))
    device = memory_device(target)
    compute = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    costs.peak_gflops = peak_gflops(compute, device=device)
    costs.bandwidth_gbs = bandwidth_gb_s(device)
    target_sizes = sizes_of(target)
    if target_sizes is None:
        costs.notes.append(f"floors need the target's weight sizes, which {type(target).__name__} does not give; "
                           "none computed")
        return
    bw = costs.bandwidth_gbs * 1e9
    t_bytes, t_params, kv = target_sizes
    target_weights, draft_weights = weights_of(target), None if draft is None else weights_of(draft)
    t_peak = own_peak(costs, "target", target_weights)

    def floor(rows: int, weight_bytes: int, params: int, kv_bytes: int, peak: float) -> float:
        return max((weight_bytes + kv_bytes) / bw, 2 * rows * params / peak)

    costs.floors_s = {"decode": floor(1, t_bytes, t_params, kv * costs.context, t_peak),
                      "verify": {k: floor(k, t_bytes, t_params, kv * costs.context, t_peak) for k in costs.verify_s},
                      "draft": {}}
    draft_sizes = None if draft is None else sizes_of(draft)
    if draft_sizes is not None:
        d_bytes, d_params, d_kv = draft_sizes
        d_peak = own_peak(costs, "draft", draft_weights)
        d_device = device_of(draft)
        if device_kind(d_device) in ("cpu", "cuda", "mps", "mlx") and device_kind(d_device) != device_kind(device):
            # a draft on another device (cuda/cpu): its floor is that device's
            d_dtype = torch_dtype(getattr(draft, "dtype", torch.float32))
            d_peak = peak_gflops(d_dtype if d_dtype in (torch.float32, torch.bfloat16) else torch.float32,
                                 device=d_device) * 1e9
            bw = bandwidth_gb_s(d_device) * 1e9
            costs.notes.append(f"the draft's floors use its own device's ({d_device}) bandwidth and peak")
        costs.floors_s["draft"] = {b: floor(b, d_bytes, d_params, d_kv * costs.context, d_peak) for b in costs.draft_s}


def torch_dtype(dtype) -> torch.dtype:
    """A model's dtype as torch's: an MLX model's by name (mlx.core.bfloat16 -> torch.bfloat16)."""
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).rsplit(".", 1)[-1], torch.float32)


def sizes_of(backend) -> tuple[int, int, int] | None:
    """model_sizes of a backend that exposes its weights, or its own `sizes()` (MLX's), else None."""
    weights = weights_of(backend)
    if weights is not None:
        return model_sizes(weights)
    sizes = getattr(backend, "sizes", None)
    return sizes() if sizes is not None else None


def own_peak(costs: Costs, name: str, weights: ModelWeights | None) -> float:
    """ops/s for a model's compute floor: its own kernel's peak where it multiplies int8 rows by GGUF blocks
    (an int8 product is not bound by the float32 matmul's rate: ~1.4x it on the AVX2 EPYC, with VNNI/AMX far
    more), else the dense matmul's. Recorded in costs.kernel_peak_gops."""
    probe = weights.peak() if weights is not None and weights.peak is not None else None
    if probe is None:
        return costs.peak_gflops * 1e9
    call, ops = probe
    call()
    peak = ops / min(timed(call) for _ in range(5))
    costs.kernel_peak_gops[name] = peak / 1e9
    return peak


def model_sizes(weights: ModelWeights) -> tuple[int, int, int]:
    """(weight bytes read per forward, matmul parameters per row, KV bytes per cached position)."""
    mats = forward_matrices(weights.lm_head, weights.layers)
    params = sum(m.numel() for m in mats)
    nbytes = weights.read_bytes or sum(m.numel() * m.element_size() for m in mats)
    return nbytes, params, weights.kv_bytes_per_position
