"""MLX's own matmul peak and memory bandwidth, measured through MLX on its default device (the GPU on Apple
silicon, the CPU in MLX's Linux build), for the cost probe's floors: an MLX model's floor is MLX's hardware's."""

from __future__ import annotations

import time

import mlx.core as mx

from hetero_sd.backends.base import forward_matrices


def best_time(fn, repeats: int) -> float:
    fn()  # (the first call allocates, compiles kernels)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def peak_gflops(dtype=mx.float32, n: int | None = None, repeats: int = 5) -> float:
    """Best of a few n^3 products, each computed (mx.eval waits for the device)."""
    n = n or (4096 if on_gpu() else 1024)
    a, b = (mx.random.normal((n, n)).astype(dtype) for _ in range(2))
    mx.eval(a, b)
    return 2 * n ** 3 / best_time(lambda: mx.eval(a @ b), repeats) / 1e9


def bandwidth_gb_s(buffer_mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth: the best of a few sums of a buffer far larger than the caches, as a step reads its weights
    (an elementwise pass, which also writes, measured half of it in MLX's CPU build and gave floors above the
    steps' own times)."""
    x = mx.ones((buffer_mb * 2**20 // 4,), dtype=mx.float32)
    mx.eval(x)
    return x.nbytes / best_time(lambda: mx.eval(mx.sum(x)), repeats) / 1e9


def sizes(lm_head: mx.array, layers, kv_heads: int, head_dim: int, dtype) -> tuple[int, int, int]:
    """(weight bytes a forward reads, matmul parameters per row, KV bytes per cached position) of an MLX model:
    its head and every layer's matrices, as costs.model_sizes counts a torch model's."""
    mats = forward_matrices(lm_head, layers)
    return sum(m.nbytes for m in mats), sum(m.size for m in mats), 2 * len(layers) * kv_heads * head_dim * dtype.size
