"""Micro-benchmark of the training forward (train/fast.py): a random 2-layer draft at SmolLM2-135M's width, one
420-token sequence with every anchor of its answer (299 blocks), forward + backward, 1 thread, CPU seconds;
the split attention by group size, the dense masked path at 24 anchors, then the split forward + chunked
cross-entropy over a 10,240-column head and a profile.   python benchmarks/train_attention_micro.py 16 32 64"""
import time, torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from hetero_sd.models.config import ArchConfig
from hetero_sd.models.draft_init import draft_config
from hetero_sd.train.model import TrainingDraft
from hetero_sd.train.fast import SplitForward
torch.set_num_threads(1)
tcfg = ArchConfig.from_dict({"model_type":"llama","hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"head_dim":64,"rms_norm_eps":1e-5,"rope_theta":100000,"vocab_size":49152,"max_position_embeddings":8192})
raw = draft_config(tcfg, num_layers=2, block_size=16, mask_token_id=16, layer_ids=[1,8,14,20,27])
embed = torch.randn(49152,576)*0.02
m = TrainingDraft(raw, embed, embed)
S, P = 420, 120
tokens = torch.randint(0,49152,(S,)); feats = torch.randn(S, 5*576)
allA = torch.arange(P, S-1)
def run(f, anchors, reps=2):
    ts=[]
    for _ in range(reps):
        t=time.process_time(); out=f(feats,tokens,anchors); out.square().sum().backward(); ts.append(time.process_time()-t)
    return min(ts)
for g in [int(x) for x in sys.argv[1:]]:
    t = run(SplitForward(m, group=g), allA)
    print(f"split group {g}: {t:.2f} s for {len(allA)} blocks: {1000*t/len(allA):.2f} ms/block", flush=True)
a24 = allA[torch.randperm(len(allA))[:24]].sort().values
t = run(m, a24); print(f"dense 24 anchors: {t:.2f} s, {1000*t/24:.2f} ms/block")
t = run(SplitForward(m, group=32), a24); print(f"split 24 anchors: {t:.2f} s, {1000*t/24:.2f} ms/block")
from hetero_sd.train.loss import chunked_cross_entropy
head = embed[:10240].contiguous()
sf = SplitForward(m, group=32)
for _ in range(2):
    t=time.process_time(); hid = sf(feats,tokens,allA); t1=time.process_time()
    lab = torch.randint(0,10240,(hid.shape[0]*15,)); w = torch.rand(lab.shape[0])
    loss = chunked_cross_entropy(hid.reshape(-1,576), head, lab, w); t2=time.process_time()
    loss.backward(); t3=time.process_time()
    print(f"fwd {t1-t:.2f} ce {t2-t1:.2f} bwd {t3-t2:.2f} per block ms {(t3-t)*1000/len(allA):.1f}")
with torch.profiler.profile() as prof:
    hid = sf(feats,tokens,allA); loss = chunked_cross_entropy(hid.reshape(-1,576), head, lab, w); loss.backward()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
