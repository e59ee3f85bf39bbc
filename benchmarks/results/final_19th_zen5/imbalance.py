"""Two threads' finishing times in every int8-row product (qgemm8), decode / verify-8 / verify-16 at 512 tokens.
Needs the instrumentation patch beside this file applied to backends/torch_backend/kernels/quant8.cpp (TSC cycles;
not in the tree: it would cost every call two rdtsc and atomics). Output: imbalance.txt."""
import torch, hetero_sd, statistics
from hetero_sd.backends.torch_backend import quant8
from hetero_sd.decoding.costs import fill_context, fill_ids, step
target = hetero_sd.load("default", None).target
ext = quant8.extension()
fill_context(target, None, 512)
base = target.length
for k in (1, 8, 16):
    ids = fill_ids(k, target.config.vocab_size)[::-1]
    for _ in range(10): step(target, base, ids, k > 1)
    ext.imbalance()
    for _ in range(200): step(target, base, ids, k > 1)
    n, a, b, blast, diff = ext.imbalance().tolist()
    print(f"rows {k}: calls {n}, thread0 mean {a/n/1e3:.1f}k cyc, thread1 {b/n/1e3:.1f}k, thread1 last {blast/n:.2f}, mean |diff| {diff/n/1e3:.1f}k cyc = {diff/max(a,b)*100:.1f}% of the longer")
