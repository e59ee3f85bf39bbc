import sys, statistics, torch
sys.path.insert(0, "/work/main")
import hetero_sd
from functools import partial
from hetero_sd.decoding.costs import fill_context, fill_ids, step, interleaved_medians, read_bandwidth_gb_s
from backends.torch_backend.kernels import ops
torch.set_num_threads(2)
q8 = ops("quant8")
rt = hetero_sd.load("default", "default")
t = rt.target
fill_context(t, None, 512)
base = t.length; V = t.config.vocab_size
configs = [tuple(int(x) for x in c.split(":")) for c in sys.argv[1].split(",")]
res = {}; outs = {}
for r in range(int(sys.argv[2])):
    bw = read_bandwidth_gb_s()
    line = [f"bw {bw:.0f}"]
    for c in configs:
        q8.pf_set(*c)
        calls = {("decode", 1): partial(step, t, base, fill_ids(1, V), False), ("verify", 8): partial(step, t, base, fill_ids(8, V), True)}
        times = interleaved_medians(calls, 30, t.synchronize)
        for k, v in times.items(): res.setdefault((c, k), []).append(v * 1e3)
        line.append(f"{c}: {times[('decode',1)]*1e3:.2f}/{times[('verify',8)]*1e3:.2f}")
        outs[c] = step(t, base, fill_ids(8, V), True).logits.clone()
    print(" | ".join(line), flush=True)
ref = outs[configs[0]]
print("bitwise", all(torch.equal(ref, o) for o in outs.values()))
for c in configs:
    print(c, "decode %.3f verify8 %.3f" % (statistics.median(res[(c, ('decode', 1))]), statistics.median(res[(c, ('verify', 8))])))
