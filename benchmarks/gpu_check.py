"""The accelerator check: one call on a GPU machine measures the accelerator path and writes ONE JSON and one log.

    python3 benchmarks/gpu_check.py                 # on a GPU machine: $OUT (or benchmarks/results/gpu)/gpu_check.json
    python3 benchmarks/gpu_check.py --tests         # then, if time is left: the CUDA tests (tests/test_cuda.py, ...)
    .venv/bin/python benchmarks/gpu_check.py --device cpu --dtype float32 --shapes tiny --tokens 12 --out /tmp/check
                                                    # anywhere: every row on a tiny shape (checks the script)

Nothing is installed on the GPU machine: its python3 has torch and transformers, and this script lays the checkout
out as the package (see `importable`). One call of `python3 benchmarks/gpu_check.py` fits 8 minutes (timeout_s
560; rows stop starting at --budget-s 440).

Per shape (random weights of SmolLM2-135M's, Qwen3-4B's and, while the budget lasts, Qwen3-8B's shapes; bf16;
context 512) and per step mode ("graphs": fixed shapes captured as CUDA graphs; "eager": the steps as they run
without capture): decode / verify-k / draft-block costs against floors from the device's own copy bandwidth and
matmul peak, and the warm-up of every step shape (`warm_s`: what capturing them costs at start). After the
end-to-end rows, the 135M shape's steps under torch.compile too (`compiled`: inductor's fused kernels, captured),
with its autoregressive and headline oracle rows. Then tokens/s of autoregressive decoding and of DFlash with an oracle draft: a z-lab-shaped random
draft runs every block (its cost is paid) and its proposals are replaced by the target's own greedy continuation,
all right (full acceptance) or the first `--stretch` right (a set acceptance); blocks 8 and 16; the draft on the
GPU and on the host CPU; sequential and overlap schedules; on block 8 at full acceptance the sequential loop
again with its acceptance on the host (`-host-acceptance`: each block read by the host three times, as before
acceptance ran on the device), and both sampling (`-t1`: temperature 1, the rejection rule). HF `generate` runs on the same weights and dtype. Each
oracle row also gives what the measured step costs predict (tau / (context catch-up + draft + verify)) and the share
of it reached by the rate after the first token (`decode_tok_s`, 1 / TPOT: the eager prefill and the first token's
wait are outside the loop the prediction is about; `tok_s` keeps them, and `of_prediction_e2e` is its share).
Rows past the time budget are skipped and listed; the JSON is rewritten after every row, so a cut-off call keeps
what it measured."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from functools import partial

STARTED = time.monotonic()  # the budget counts from here: torch's import and CUDA's start are in the call's time
# The profiler (launches a step) keeps CUPTI loaded between its sessions instead of tearing it down with captured
# CUDA graphs alive, as torch does for inductor's own graphs (read when a profile ends)
os.environ.setdefault("TEARDOWN_CUPTI", "0")
ROW_S = 12.0  # an oracle row starts only with this much of the budget left (3 generations of 128 tokens, a 4B shape)
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def importable() -> None:
    """On a bare checkout (a GPU machine's python3 has torch and transformers, not this package installed): the
    package as an install lays it out, backends/, ane_compiler/ and tui/ inside the hetero_sd namespace."""
    try:
        import hetero_sd.backends  # noqa: F401
    except ImportError:
        for name in ("backends", "ane_compiler", "tui"):
            link = ROOT / "hetero_sd" / name
            if not link.exists():
                link.symlink_to(Path("..") / name)
        sys.path.insert(0, str(ROOT))
        for name in [m for m in sys.modules if m == "hetero_sd" or m.startswith("hetero_sd.")]:
            del sys.modules[name]


importable()

from hetero_sd.backends.base import WrappedDraft, uploaded  # noqa: E402
from hetero_sd.backends.policy import LoadPolicy  # noqa: E402
from hetero_sd.backends.torch_backend import TorchTarget, load_draft  # noqa: E402
from hetero_sd.backends.torch_backend.cpu import native_bf16  # noqa: E402
from hetero_sd.backends.torch_backend.steps import bucket  # noqa: E402
from hetero_sd.decoding import costs as cost_probe  # noqa: E402
from hetero_sd.models.config import ArchConfig, DraftConfig  # noqa: E402
from hetero_sd.models.draft_init import draft_config, random_layer_ids  # noqa: E402
from hetero_sd.runtime import Runtime  # noqa: E402

SHAPES = {  # HF config keys of the public models, weights random
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False, draft_layers=2),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5, draft_layers=2),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, draft_layers=5),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, draft_layers=5),
}
BLOCK = 16  # the z-lab drafts' block size


def policy(**kw) -> LoadPolicy:
    """A load policy with the torch ops (the fused C++ ops are the CPU's own path, and a CPU draft here must
    not spend the call building them); fields a policy lacks are left out."""
    names = {f.name for f in fields(LoadPolicy)}
    kw = {"fused": False, "quant": False, "draft_int8_head": False, "draft_int8_layers": False, **kw}
    return LoadPolicy(**{k: v for k, v in kw.items() if k in names})


class NullTokenizer:
    """Random weights have no text: generations are compared as token ids."""

    backend_tokenizer = None

    def decode(self, ids, **kwargs) -> str:
        return ""


class OracleDraft(WrappedDraft):
    """A real draft whose every block runs (its cost is paid, its caches kept as in decoding) and whose proposals
    are replaced by the true continuation: all right, or the first `right` per block (then the true token is the
    second choice, so the overlap schedule's guesses can find it)."""

    def __init__(self, inner, sequence: list[int], vocab: int, right: int | None = None):
        super().__init__(inner)
        self.sequence, self.vocab, self.right = sequence, vocab, right

    def propose(self, anchor: int, position: int | None = None, size: int | None = None):
        logits = self.inner.propose(anchor, position, size)
        at = self.inner.context_length if position is None else position
        n = logits.shape[0]
        right = n if self.right is None else self.right
        # built where the draft's logits are (a [n, vocab] host tensor copied up per block cost ~1-3 ms, a
        # captured verify step's size), and without a read of the device: the ids go up from pinned memory, and no
        # boolean index (its shape is data: a sync), so that the oracle adds no stall a real draft does not have
        truth = uploaded(torch.tensor((self.sequence[at + 1:at + 1 + n] + [0] * n)[:n]), logits.device)
        rows = torch.arange(n, device=logits.device)
        wrong = rows >= right
        out = torch.zeros(n, self.vocab, device=logits.device)
        out[rows, truth] = torch.where(wrong, 15.0, 20.0)  # where wrong, the truth is the second choice
        out[rows, (truth + 1) % self.vocab] = torch.where(wrong, 20.0, 0.0)
        return out


def hf_model(shape: dict, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = {k: v for k, v in shape.items() if k not in ("model_type", "draft_layers")}
    cfg = AutoConfig.for_model(shape["model_type"], max_position_embeddings=4096, **keys)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # A random model's logits are ~N(0, 1) over the vocabulary: the top two ~0.2 apart, within bf16's rounding,
    # so a verify block and one-row decoding would pick different tokens within a few positions and the oracle
    # (which proposes the AR transcript) would stop being right. Layers that write little into the residual
    # stream keep each position's hidden state near its token's embedding, and (tied) logits decisive; the
    # shapes, hence every cost, are unchanged.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-2)
            layer.mlp.down_proj.weight.mul_(1e-2)
    return model.eval(), cfg


def draft_tensors(raw: dict, device: str, dtype: torch.dtype, std: float = 0.02) -> dict:
    """A z-lab-shaped draft's tensors, random, made on the device (a 5-layer 4096-wide draft is 1B weights)."""
    h, i, hd = raw["hidden_size"], raw["intermediate_size"], raw["head_dim"]
    nq, nkv = raw["num_attention_heads"] * hd, raw["num_key_value_heads"] * hd
    feats = len(raw["dflash_config"]["target_layer_ids"]) * h
    g = torch.Generator(device=device).manual_seed(1)

    def mat(*s):
        return (torch.randn(*s, generator=g, device=device) * std).to(dtype)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    t = {"fc.weight": mat(h, feats), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for n in range(raw["num_hidden_layers"]):
        p = f"layers.{n}."
        t |= {p + "self_attn.q_proj.weight": mat(nq, h), p + "self_attn.k_proj.weight": mat(nkv, h),
              p + "self_attn.v_proj.weight": mat(nkv, h), p + "self_attn.o_proj.weight": mat(h, nq),
              p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
              p + "mlp.gate_proj.weight": mat(i, h), p + "mlp.up_proj.weight": mat(i, h),
              p + "mlp.down_proj.weight": mat(h, i), p + "input_layernorm.weight": ones(h),
              p + "post_attention_layernorm.weight": ones(h)}
    return t


class Check:
    def __init__(self, args):
        self.args, self.began = args, STARTED
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.out / "gpu_check.log", "a")
        dev = args.device
        self.result = {"device": cost_probe.accelerator_name(dev) or f"CPU: {cost_probe.cpu_name()}",
                       "host_cpu": cost_probe.cpu_name(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "python": platform.python_version(),
                       "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                       "dtype": args.dtype, "context": args.context, "prompt": args.prompt, "new_tokens": args.tokens,
                       "floors": {}, "shapes": {}, "e2e": {}, "skipped": [], "errors": []}

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.began:7.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.monotonic() - self.began, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=1))

    def time_left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.began)

    def row(self, name: str, need_s: float, fn) -> None:
        """Run one row if the budget allows it; an error is recorded and the check goes on."""
        if self.fits(name, need_s):
            self.attempt(name, fn)
        self.save()

    def fits(self, name: str, need_s: float) -> bool:
        if self.time_left() >= need_s:
            return True
        self.result["skipped"].append(f"{name}: {self.time_left():.0f} s left, ~{need_s:.0f} s needed")
        self.log(f"skip {name}")
        return False

    def attempt(self, name: str, fn) -> None:
        """fn(); an error is recorded and the check goes on (a failed mode or row must not lose the others)."""
        try:
            fn()
        except Exception as e:
            self.result["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            self.log(f"error {name}: {type(e).__name__}: {e}")
            self.save()
            free_memory(self.args.device)

    def floors(self) -> None:
        dev, f = self.args.device, self.result["floors"]
        f["copy_gb_s"] = round(cost_probe.bandwidth_gb_s(dev), 1)
        for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            f[f"{name}_tflops"] = round(cost_probe.peak_gflops(dt, device=dev) / 1e3, 1)
        self.log(f"floors {f}")


def free_memory(device: str) -> None:
    """Drop what is unreferenced (a backend's step objects hold it in cycles) and give the GPU's cached blocks back.
    After a failed capture torch before 2.12 may refuse to empty its cache (pytorch#180395): the check goes on."""
    gc.collect()
    if device.startswith("cuda"):
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a figure lost here is worth less than the rows after it
            pass


def build(check: Check, shape_name: str, steps: str, draft_device: str):
    """(HF model, our target, its draft on draft_device) on the same random weights."""
    a, dev, dtype = check.args, check.args.device, getattr(torch, check.args.dtype)
    shape = SHAPES[shape_name]
    model, cfg = check.hf if check.hf_shape == shape_name else (None, None)
    if model is None:
        check.hf = check.hf_shape = None
        free_memory(dev)
        model, cfg = hf_model(shape, dev, dtype)
        check.hf, check.hf_shape = (model, cfg), shape_name
    folder = Path(tempfile.mkdtemp(prefix=f"gpu-check-{shape_name}-"))
    (folder / "config.json").write_text(cfg.to_json_string())
    arch = ArchConfig.from_dict(json.loads(cfg.to_json_string()))
    raw = draft_config(arch, num_layers=shape["draft_layers"], block_size=BLOCK, mask_token_id=arch.vocab_size - 1,
                       layer_ids=random_layer_ids(arch.num_hidden_layers))
    dcfg = DraftConfig.from_dict(raw)
    tensors = dict(model.state_dict())
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    target = TorchTarget(arch, tensors, folder, dev, dtype, dcfg.target_layer_ids, a.context + 2 * a.tokens + 64,
                         policy=policy(steps=steps, gemm=steps != "compiled"), flags=frozenset())
    d_dtype = dtype if draft_device == dev else getattr(torch, check.result["cpu_draft_dtype"])
    draft = load_draft(folder, dcfg, target, draft_device, d_dtype, raw["dflash_config"]["mask_token_id"],
                       tensors=draft_tensors(raw, draft_device, d_dtype), int8_head=False,
                       # (a host draft beside a GPU target: no native GEMM kernel to build inside a timed row)
                       policy=policy(steps=steps if draft_device == dev else "eager",
                                     gemm=steps != "compiled" and draft_device == dev))
    return model, target, draft


def measure_shape(check: Check, shape_name: str) -> None:
    a, res = check.args, check.result["shapes"].setdefault(shape_name, {})
    for steps in a.modes:
        check.attempt(f"costs {shape_name} {steps}", lambda steps=steps: measure_mode(check, shape_name, steps, res))
    if "floor_ms" in res and "decode_ms" in res:
        res["decode_x_floor"] = res["decode_ms"] / res["floor_ms"]
    other = next((m for m in a.modes[1:] if m in res), None)
    if other and "decode_ms" in res:
        res[f"decode_speedup_vs_{other}"] = res[other]["decode_ms"] / res["decode_ms"]
    check.save()


def measure_mode(check: Check, shape_name: str, steps: str, res: dict) -> None:
    a = check.args
    _, target, draft = build(check, shape_name, steps, a.device)
    began = time.perf_counter()  # every step shape up to the probe's context: captures (and compilations) at start
    ran = target.warm(a.context + 16) + draft.warm(a.context + 16)
    target.synchronize()
    warm_s = time.perf_counter() - began
    c = cost_probe.measure_costs(target, draft, context=a.context, ks=(1, 2, 4, 8, 16), blocks=(2, 4, 8, 16),
                                 repeats=a.repeats, machine=not res.get("floor_ms"))
    row = {"decode_ms": c.decode_s * 1e3, "verify_ms": {k: v * 1e3 for k, v in c.verify_s.items()},
           "draft_ms": {b: v * 1e3 for b, v in c.draft_s.items()},
           "context_ms": {k: v * 1e3 for k, v in catch_up_s(target, draft, a).items()},
           "prefill_ms": prefill_s(target, a) * 1e3, "steps": target.steps, "warm_s": warm_s, "warm_steps": ran,
           "captured": bool(target.fixed and target.fixed.runner.captures), "draft_steps": draft.steps,
           "graphs_captured": {"target": target.fixed.runner.captures if target.fixed else 0,
                               "draft": draft.fixed.runner.captures if draft.fixed else 0}, "mode": target.mode,
           "verify_x_decode": {k: v / c.decode_s for k, v in c.verify_s.items()},
           "draft_x_decode": {b: v / c.decode_s for b, v in c.draft_s.items()}}
    if c.floors_s:
        res |= {"floor_ms": c.floors_s["decode"] * 1e3,
                "floor_verify_ms": {k: v * 1e3 for k, v in c.floors_s["verify"].items()},
                "floor_draft_ms": {b: v * 1e3 for b, v in c.floors_s["draft"].items()},
                "floor_from": f"{c.device or c.cpu}: {c.bandwidth_gbs:.0f} GB/s, {c.peak_gflops:.0f} GFLOPS"}
    if steps == a.modes[0]:
        res |= row
    else:
        res[steps] = row
    check.log(f"{shape_name} {steps}: decode {row['decode_ms']:.3f} ms, verify-16 "
              f"{row['verify_x_decode'][16]:.2f}x, draft-8 {row['draft_x_decode'].get(8, 0):.2f}x, "
              f"prefill-{a.prompt} {row['prefill_ms']:.2f} ms, warm-up of {ran} steps {warm_s:.1f} s")
    del target, draft


def catch_up_s(target, draft, a) -> dict:
    """Median seconds of the draft's context catch-up on k positions (k in the buckets 1-16): the third part of a
    speculative step beside the draft block and the verify (the positions a verify accepted join the draft's
    context before its next block), at the probe's context length."""
    at_target, at_draft = target.length, draft.context_length
    try:
        cost_probe.fill_context(target, draft, a.context)
        features = target.forward(cost_probe.fill_ids(16, target.config.vocab_size)).features
        target.crop(target.length - 16)
        base = draft.context_length

        def catch_up(k):
            draft.add_context(features[:k])
            draft.crop(base)
        return cost_probe.interleaved_medians({k: partial(catch_up, k) for k in (1, 2, 4, 8, 16)}, a.repeats,
                                              draft.synchronize)
    finally:
        target.crop(at_target)
        draft.crop(at_draft)


def prefill_s(target, a) -> float:
    """Median seconds of the end-to-end rows' prefill (--prompt tokens into an empty cache): what the first token
    waits for (in chunks of captured steps, or one eager forward)."""
    ids = cost_probe.fill_ids(a.prompt, target.config.vocab_size)

    def prefill():
        target.crop(0)
        target.forward(ids, last_only=True)
    try:
        return cost_probe.interleaved_medians({"prefill": prefill}, a.repeats, target.synchronize)["prefill"]
    finally:
        target.crop(0)


def timed_generations(rt: Runtime, prompt: list[int], tokens: int, runs: int, **kw):
    # warm-up over the whole length: every step shape (and its capture) the timed runs meet, the allocator
    rt.generate(prompt, max_new_tokens=tokens, stop_at_eos=False, **kw)
    outs, seconds, tpot = [], [], []
    for _ in range(runs):
        began = time.perf_counter()
        outs.append(rt.generate(prompt, max_new_tokens=tokens, stop_at_eos=False, **kw))
        seconds.append(time.perf_counter() - began)
        tpot.append(outs[-1].stats.tpot_s)
    return outs[-1], statistics.median(seconds), statistics.median(tpot)


def compiled_steps(check: Check, shape_name: str) -> None:
    """The steps under torch.compile, then captured (steps="compiled"): their costs beside the captured eager
    kernels' ("graphs"), the warm-up's compilations included in warm_s, and the autoregressive and headline oracle
    rows end to end: which of the two the default should be is this measurement's to say."""
    a, res = check.args, check.result["shapes"].setdefault(shape_name, {})
    check.attempt(f"costs {shape_name} compiled", lambda: measure_mode(check, shape_name, "compiled", res))
    if "compiled" in res:
        # Dynamo's compilations in this process so far (every step function's; a few each is the design)
        res["compiled"]["compilations"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if "compiled" in res and "decode_ms" in res and a.modes[0] != "compiled":
        res["compiled"]["decode_speedup_vs_" + a.modes[0]] = res["decode_ms"] / res["compiled"]["decode_ms"]
    check.save()
    free_memory(a.device)
    if check.fits(f"e2e {shape_name} compiled", 2 * ROW_S):
        check.attempt(f"e2e {shape_name} compiled",
                      lambda: e2e_placement(check, shape_name, "compiled", a.device, {}, headline_only=True))
    free_memory(a.device)


def end_to_end(check: Check, shape_name: str) -> None:
    a = check.args
    answers: dict = {}
    for steps in a.modes:
        for draft_device in a.draft_devices:
            if draft_device != a.device and steps != a.modes[0]:
                continue  # the CPU draft beside the GPU: the captured target only
            name = f"e2e {shape_name} {steps} draft on {draft_device}"
            if check.fits(name, 2 * ROW_S):  # (its build and autoregressive row, then its oracle rows one by one)
                check.attempt(name, lambda steps=steps, d=draft_device: e2e_placement(check, shape_name, steps, d,
                                                                                      answers))
            free_memory(a.device)
    if a.modes[0] in answers and check.fits(f"e2e {shape_name} hf-generate", ROW_S):
        check.attempt(f"e2e {shape_name} hf-generate", lambda: hf_generate(check, shape_name, answers[a.modes[0]]))


@dataclass
class Placement:
    """One placement's models and what its rows share: the prompt and the autoregressive transcript per step mode."""
    check: Check
    shape: str
    steps: str
    draft_device: str
    target: object
    draft: object
    prompt: list
    answers: dict


def e2e_placement(check: Check, shape_name: str, steps: str, draft_device: str, answers: dict,
                  headline_only: bool = False) -> None:
    """AR (once per step mode) and every oracle row of one placement (or its headline row alone: the first block,
    full acceptance, sequential), each timed after a warm-up of its own; a row that raises is an error of that
    row, and the rows after it still run."""
    a = check.args
    _, target, draft = build(check, shape_name, steps, draft_device)
    vocab = target.config.vocab_size
    prompt = check.prompt = torch.randint(10, vocab - 1, (a.prompt,), generator=torch.Generator().manual_seed(3)).tolist()
    p = Placement(check, shape_name, steps, draft_device, target, draft, prompt, answers)
    key = f"{shape_name}/ar/{steps}"
    if key not in check.result["e2e"]:
        check.attempt(key, partial(ar_row, p, key))
    if steps in answers:
        place = f"{torch.device(a.device).type}/{torch.device(draft_device).type}"
        blocks, rights = a.blocks, ((None, "full"), (a.stretch, f"right{a.stretch}"))
        if headline_only:
            blocks, rights = blocks[:1], rights[:1]
        for block in blocks:
            for right, label in rights:
                headline = block == a.blocks[0] and right is None
                for schedule, acceptance, sampled in ([("sequential", "device", False)] if headline_only
                                                      else variants(a.schedules, headline)):
                    name = (f"{shape_name}/oracle-{label}-b{block}/{place}/{schedule}"
                            f"{'-t1' * sampled}{'-host-acceptance' * (acceptance == 'host')}/{steps}")
                    if check.fits(name, ROW_S):
                        check.attempt(name, partial(oracle_row, p, name, block, right, schedule, acceptance, sampled))
                        check.save()
    del p, target, draft


def ar_row(p: Placement, key: str) -> None:
    plain = Runtime(p.target, None, NullTokenizer(), [], {"notes": []}, lookup=0)
    base, secs, tpot = timed_generations(plain, p.prompt, p.check.args.tokens, p.check.args.runs, speculative=False)
    p.check.result["e2e"][key] = {"tok_s": len(base.token_ids) / secs, "decode_tok_s": rate(tpot), "tau": 1.0,
                                  "launches_per_step": launches(plain, p.prompt, p.check.args.tokens,
                                                                lambda s: s.num_generated_tokens, speculative=False)}
    p.answers[p.steps] = base.token_ids
    p.check.log(f"{key}: {p.check.result['e2e'][key]['tok_s']:.1f} tok/s")


PROFILED = 32  # tokens of the profiled generation: an eager step is thousands of profiler events, and reading
#               them back for a whole row's tokens took seconds of the call's budget; a step's launches are an average


def launches(rt: Runtime, prompt: list[int], tokens: int, steps, **kw) -> dict:
    """One more generation (of at most PROFILED tokens) under torch.profiler: what the host launched a step
    (steps(stats): the loop's steps; the prefill's launches are in the total). On CUDA the runtime API's kernel
    launches (each op outside a graph), graph launches and copies; a launch-bound loop shows here before it shows in
    tok/s. Elsewhere torch's ops."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(rt.target.device).type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        out = rt.generate(prompt, max_new_tokens=min(tokens, PROFILED), stop_at_eos=False, **kw)
    # the host's side only: a device's own records (a copy's, a graph's replayed nodes) are not launches
    names = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
    kinds = {"kernels": ("LaunchKernel",), "graphs": ("GraphLaunch",), "copies": ("cudaMemcpy",)} if cuda else \
        {"ops": ("aten::",)}
    n = max(1, steps(out.stats))
    return {"steps": n, **{k: sum(c for name, c in names.items() if any(m in name for m in marks)) / n
                           for k, marks in kinds.items()}}


def rate(tpot: float) -> float | None:
    """Tokens a second from the time per output token (None where a generation gave no second token)."""
    return 1 / tpot if tpot > 0 else None


def oracle_row(p: Placement, name: str, block: int, right: int | None, schedule: str, acceptance: str,
               sampled: bool) -> None:
    a, e2e = p.check.args, p.check.result["e2e"]
    shape_costs = p.check.result["shapes"].get(p.shape, {})
    costs = shape_costs if p.steps == a.modes[0] else shape_costs.get(p.steps, {})
    ar, answer = e2e[f"{p.shape}/ar/{p.steps}"], p.answers[p.steps]
    oracle = OracleDraft(p.draft, p.prompt + answer, p.target.config.vocab_size, right)
    rt = Runtime(p.target, oracle, NullTokenizer(), [], {"notes": []}, schedule, block, lookup=0, acceptance=acceptance)
    kw = dict(temperature=1.0, seed=0, rule="rejection") if sampled else {}
    out, secs, tpot = timed_generations(rt, p.prompt, a.tokens, a.runs, **kw)
    s = out.stats
    row = {"tok_s": len(out.token_ids) / secs, "decode_tok_s": rate(tpot), "tau": s.tau, "acceptance": s.acceptance,
           "identical_to_ar": None if sampled else out.token_ids == answer,
           "ar_tok_s": ar["tok_s"], "ar_decode_tok_s": ar["decode_tok_s"],
           "fallback": s.fallback, "notes": s.notes[-3:]}  # a draft that failed: the target finished alone
    row["speedup_vs_ar"] = row["tok_s"] / row["ar_tok_s"]
    if schedule == "sequential" and acceptance == "device" and not sampled and right is None:
        row["launches_per_step"] = launches(rt, p.prompt, a.tokens, lambda s: s.num_drafts + s.plain_steps)
    if row["decode_tok_s"] and row["ar_decode_tok_s"]:
        row["decode_speedup_vs_ar"] = row["decode_tok_s"] / row["ar_decode_tok_s"]
    # a step: the draft's catch-up on the positions the last verify kept (tau of them, as a captured bucket), the
    # draft block and the verify of the block. The prediction is the loop's steady rate, so it is set against the
    # rate after the first token (the prefill, eager, and the first token's wait are in tok_s: of_prediction_e2e)
    v, d = costs.get("verify_ms", {}).get(block), costs.get("draft_ms", {}).get(block)
    cx = costs.get("context_ms", {}).get(bucket(math.ceil(s.tau)))
    if v and d and cx is not None and p.draft_device == a.device:
        row["predicted_tok_s"] = s.tau / ((v + d + cx) / 1e3)
        row["of_prediction"] = (row["decode_tok_s"] or 0.0) / row["predicted_tok_s"]
        row["of_prediction_e2e"] = row["tok_s"] / row["predicted_tok_s"]
    e2e[name] = row
    p.check.log(f"{name}: {row['tok_s']:.1f} tok/s, tau {s.tau:.2f}"
                + (f", {row['of_prediction']:.2f} of the prediction" if "of_prediction" in row else "")
                + (f", FELL BACK: {s.fallback}" if s.fallback else ""))


def variants(schedules: list[str], headline: bool) -> list[tuple[str, str, bool]]:
    """(schedule, acceptance, sampled) of the oracle rows: each schedule greedy with its acceptance on the device
    where it can be (the sequential loop's; what 'auto' does on an accelerator, and on the CPU here too). On the
    headline row (first block, full acceptance) the sequential loop also with its acceptance on the host, and both
    again sampling (temperature 1, the rejection rule; `-t1`): what the device's acceptance is worth, in one run.
    (Sampled, the oracle's proposals are the greedy transcript: acceptance is the target's p of it, tau is low, and
    the rows measure the loop's cost per step.)"""
    rows = [(schedule, "device", False) for schedule in schedules]
    if headline and "sequential" in schedules:
        at = schedules.index("sequential") + 1
        rows[at:at] = [("sequential", "host", False), ("sequential", "device", True), ("sequential", "host", True)]
    return rows


def hf_generate(check: Check, shape_name: str, ours: list[int]) -> None:
    """transformers' generate on the same weights, device and dtype, greedy, the same prompt and length."""
    a, e2e = check.args, check.result["e2e"]
    model, _ = check.hf
    ids = torch.tensor([check.prompt], device=a.device)
    with torch.inference_mode():
        gen = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)  # noqa: E731
        gen(8)
        sync = cost_probe.device_sync(a.device)

        def timed(n):
            sync()
            began = time.perf_counter()
            out = gen(n)
            sync()
            return out, time.perf_counter() - began
        _, first = timed(1)  # the prefill and the first token: generate's decode rate is what the rest took
        out, secs = timed(a.tokens)
    theirs = out[0, ids.shape[1]:].tolist()
    e2e[f"{shape_name}/hf-generate"] = {"tok_s": len(theirs) / secs, "tau": 1.0, "same_tokens_as_ours": theirs == ours,
                                        "decode_tok_s": (len(theirs) - 1) / max(secs - first, 1e-9)}
    check.log(f"{shape_name}/hf-generate: {e2e[f'{shape_name}/hf-generate']['tok_s']:.1f} tok/s")


def cuda_tests(out: Path) -> int:
    """tests/test_cuda.py and the fixed-step and device-cost tests, with their log in `out`."""
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--tb=short",
           "tests/test_cuda.py", "tests/test_fixed_steps.py", "tests/test_device_costs.py"]
    # a hung test must not take the call's whole time; 300 s leaves room for the first CPU-target test, which
    # compiles the C++ kernels on a machine that has never built them
    if importlib.util.find_spec("pytest_timeout"):
        cmd.insert(3, "--timeout=300")
    with open(out / "cuda-tests.log", "w") as log:
        try:  # (pytest-timeout may be missing there: the whole run has a limit of its own)
            return subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=520).returncode
        except subprocess.TimeoutExpired:
            log.write("\nstopped after 520 s\n")
            return 124


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="smollm2-135m,qwen3-4b,qwen3-8b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cpu-draft-dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"),
                   help="the draft's dtype on the host CPU (auto: bfloat16 where the CPU multiplies it natively)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of the end-to-end rows")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    p.add_argument("--runs", type=int, default=2, help="timed generations per row (median)")
    p.add_argument("--repeats", type=int, default=5, help="cost probe: timed calls per cost (at least)")
    p.add_argument("--blocks", default="8,16")
    p.add_argument("--stretch", type=int, default=2, help="drafts right per block in the set-acceptance rows")
    p.add_argument("--modes", default="graphs,eager", help="step modes, the first one the headline")
    p.add_argument("--draft-devices", default=None, help="default: the device, then the host CPU")
    p.add_argument("--schedules", default="sequential,overlap")
    p.add_argument("--e2e-shapes", default="smollm2-135m,qwen3-4b", help="shapes that also run end to end")
    p.add_argument("--compiled-shapes", default="smollm2-135m",
                   help="shapes whose steps are also measured under torch.compile (after the end-to-end rows)")
    p.add_argument("--budget-s", type=float, default=440.0, help="stop starting rows after this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/gpu",
                   help="folder of gpu_check.json and gpu_check.log (RESULTS.md cites results/gpu/gpu_check.json)")
    p.add_argument("--tests", action="store_true", help="run the CUDA tests instead (log beside the JSON)")
    a = p.parse_args(argv)
    if a.tests:
        return cuda_tests(Path(a.out))
    a.modes, a.blocks = a.modes.split(","), [int(b) for b in a.blocks.split(",")]
    a.schedules = a.schedules.split(",")
    a.draft_devices = (a.draft_devices or f"{a.device},cpu").split(",")
    if a.device == "cpu":
        a.draft_devices = ["cpu"]
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}: use some of {', '.join(SHAPES)}")
    check = Check(a)
    check.result["cpu_draft_dtype"] = (("bfloat16" if native_bf16() else "float32") if a.cpu_draft_dtype == "auto"
                                       else a.cpu_draft_dtype)
    check.hf = check.hf_shape = None
    check.log(f"{check.result['device']}, torch {torch.__version__}, host {check.result['host_cpu']}")
    if a.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(a.device))
        check.result["gpu"] = {"memory_gb": round(props.total_memory / 1e9, 1), "sms": props.multi_processor_count,
                               "capability": f"{props.major}.{props.minor}"}
    check.row("floors", 20, check.floors)
    shapes = a.shapes.split(",")
    e2e_shapes = [s for s in a.e2e_shapes.split(",") if s in shapes] or shapes[:1]
    # the shapes that also run end to end (the 135M and 4B) first: their costs, then their end-to-end
    # rows (which read those costs for their predictions); the other shapes' costs while the budget lasts
    for name in e2e_shapes:
        check.row(f"costs {name}", 40, lambda name=name: measure_shape(check, name))
    for name in e2e_shapes:
        check.row(f"e2e {name}", 60, lambda name=name: end_to_end(check, name))
    for name in (s for s in a.compiled_shapes.split(",") if s in shapes and "compiled" not in a.modes):
        check.row(f"compiled {name}", 120, lambda name=name: compiled_steps(check, name))  # (~10 compilations)
    for name in (s for s in shapes if s not in e2e_shapes):
        check.row(f"costs {name}", 90, lambda name=name: measure_shape(check, name))
    check.save()
    check.log(f"wrote {check.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
