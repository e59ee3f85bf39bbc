"""Regenerate benchmarks/RESULTS.md from the JSON under benchmarks/results/ that it cites.

    python benchmarks/results_md.py                          # every section, from the files in SOURCES
    python benchmarks/results_md.py RUN.json [RUN2.json] --out X.md [--chart X.png]   # bench JSON files only

Every figure in RESULTS.md comes from a JSON file named beside it; nothing is typed in by hand. Each section
names its machine (from the JSON) and its date (the JSON's own date where it has one, else the day its
content was first committed, else today for a file not committed yet)."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def load(paths: list[str]) -> list[tuple[str, dict]]:
    """(name, run) per run: a matrix file (several placements/temperatures) gives one per run."""
    out = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        for res in doc.get("runs", [doc]):
            m = res["models"]
            where = f"{m['target_device']}/{m['draft_device']}, T={res['settings']['temperature']:g}"
            out.append((f"{Path(p).stem} ({where})", res))
    return out


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def machine_section(runs: list[tuple[str, dict]]) -> list[str]:
    m = runs[0][1]["machine"]
    return ["## Machine", "", f"- CPU: {m['cpu']} ({m['cores']} cores), {m['platform']}",
            f"- Python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), CUDA: {m['cuda'] or 'none'}",
            f"- Target: `{runs[0][1]['models']['target']}`; draft: `{runs[0][1]['models']['draft']}` "
            f"on {runs[0][1]['models']['draft_device']}", ""]


def run_section(name: str, res: dict) -> list[str]:
    s = res["settings"]
    lines = [f"## {name}", "", f"Command: `{res['command']}`", "",
             *(["**Interrupted**: only the prompts that finished are counted.", ""] if res.get("interrupted") else []),
             f"T={s['temperature']}, {s['max_new_tokens']} new tokens, {len(res['prompts'])} prompts; "
             f"lossless (identical to the baseline): {res['lossless']}", "",
             *table("prompts", "baseline tok/s", "DFlash tok/s", "speedup", "tau", "loop share", "loop-free tau", "loop-free speedup")]
    for cat, c in res.get("categories", {}).items():
        lines.append(f"| {cat or 'uncategorised'} ({c['prompts']}) | {c['baseline_tokens_per_s']:.1f} | {c['spec_tokens_per_s']:.1f} | "
                     f"{c['speedup']:.2f}x | {c['tau']:.2f} | {loop_cells(c)} |")
    lines.append(f"| **all** | {res['baseline_tokens_per_s']:.1f} | {res['spec_tokens_per_s']:.1f} | "
                 f"{res['speedup']:.2f}x | {res['tau']:.2f} | {loop_cells(res.get('loops', {}))} |")
    lines.append("")
    if res.get("loops"):
        lines += [f"Loop share: the tokens that end a run of {res['loops']['ngram']} tokens already generated earlier in the same "
                  "answer (hetero_sd/bench/repetition.py); loop-free tau and speedup count only the other tokens.", ""]
    if any("spec_tokens" in r and "steps" not in r for r in res["prompts"]):  # JSON from before pooled rows
        lines += ["(In this file a category's tau is the mean of its prompts' taus; the **all** row pools every "
                  "verify step.)", ""]
    if res.get("peers"):
        lines += peers_table(res)
    if res["models"]["draft_device"] == "ane-sim":
        lines += ["`ane-sim` is an fp16 emulation of the ANE graph on the CPU: its tau and drift are meaningful, "
                  "its speed says nothing about the Neural Engine.", ""]
    if res.get("drift"):
        d = res["drift"]
        lines += [f"Drift of {d['device']} against the float32 draft on the same prompts: tau ratio "
                  f"{d['tau_ratio']:.3f} ({d['tau_device']:.2f} / {d['tau_reference']:.2f}), cosine {d['cosine']:.6f} "
                  f"(min {d['cosine_min']:.6f}), top-1 agreement {d['top1_agreement']:.1%}, KL {d['kl']:.1e}.", ""]
    if res.get("floor"):
        f = res["floor"]
        lines += [f"Floor: {f['step_bytes'] / 1e6:.0f} MB read per float32 decode step (weights + KV at "
                  f"{f['context']} positions) at a measured {f['read_bandwidth_gb_s']:.1f} GB/s: at most "
                  f"{f['floor_tokens_per_s']:.1f} tok/s for one token per weight read."
                  + (f" The GGUF peer reads {f['gguf_bytes'] / 1e6:.0f} MB per step (quantised): its floor is "
                     f"{f['gguf_floor_tokens_per_s']:.1f} tok/s." if "gguf_bytes" in f else ""), ""]
    return lines


def pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def loop_cells(d: dict) -> str:
    """loop share | loop-free tau | loop-free speedup (dashes where the JSON predates loop metrics)."""
    speedup = d.get("speedup_loop_free")
    return f"{pct(d.get('loop_share'))} | {num(d.get('tau_loop_free'))} | {'-' if speedup is None else f'{speedup:.2f}x'}"


def peers_table(res: dict) -> list[str]:
    """Our two modes and every peer: tok/s, tau where reported, ratios theirs / ours, loop share, weights."""
    fractions = res.get("floor", {}).get("fraction_of_floor", {})
    base, spec = res["baseline_tokens_per_s"], res["spec_tokens_per_s"]
    lines = table("system", "tok/s", "tau", "vs hetero-sd DFlash", "vs hetero-sd autoregressive", "loop share",
                  "of its decode floor", "reads", "note")
    share = pct(res.get("loops", {}).get("loop_share"))
    m = res["models"]
    source = f" (dequantised from {Path(m['gguf']).name})" if m.get("gguf") else ""
    ours = (f"our HF target folder{source} and draft, target on {m['target_device']}, draft on "
            f"{m['draft_device']} (float32 on cpu, bfloat16 on accelerators)")
    for label, tps, tau in (("hetero-sd autoregressive", base, None), ("hetero-sd DFlash", spec, res["tau"])):
        lines.append(f"| {label} | {tps:.1f} | {num(tau)} | {tps / spec:.2f}x | {tps / base:.2f}x | {share} | "
                     f"{pct(fractions.get(label))} | {ours} | this run |")
    for p in res["peers"]:
        if p["skipped"]:
            lines.append(f"| {p['name']} | - | - | - | - | - | - | - | skipped: {p['note']} |")
            continue
        lines.append(f"| {p['name']} | {p['tokens_per_s']:.1f} | {num(p.get('tau'))} | {ratio(p['ratio_to_spec'])} | "
                     f"{ratio(p.get('ratio_to_autoregressive'))} | {pct(p.get('loop_share'))} | "
                     f"{pct(fractions.get(p['name']))} | {p.get('weights') or '-'} | {p['note']}{identity(p)} |")
    return lines + [""]


def identity(p: dict) -> str:
    """z-lab's reference: identical to our T=0 tokens, or per prompt the first differing token."""
    if "identical" not in p:
        return ""
    if p["identical"]:
        text = "; tokens identical to ours on every prompt"
    else:
        text = "; tokens differ from ours: " + ", ".join(
            f"prompt {i} at token {q['first_divergence']}" for i, q in enumerate(p["prompts"]) if not q.get("identical", True))
    steps = [(i, q["acceptance_differs_at_token"], q["tokens"]) for i, q in enumerate(p["prompts"])
             if q.get("acceptance_differs_at_token") is not None]
    if any("acceptance_differs_at_token" in q for q in p["prompts"]):
        text += ("; acceptance lengths as ours on every prompt" if not steps else "; acceptance lengths differ from "
                 + ", ".join(f"token {t} of {n} (prompt {i})" for i, t, n in steps))
    return text


def verdict(runs: list[tuple[str, dict]]) -> list[str]:
    """Where we are ahead and where behind, from the numbers: each of our two modes against each peer
    that ran, and DFlash against our own autoregressive decoding."""
    lines = ["## Ahead and behind", "", "Ratios are our tok/s over theirs, measured in the same run.", ""]
    for name, res in runs:
        lines.append(f"- {name}: DFlash vs our own autoregressive decoding: {res['speedup']:.2f}x "
                     f"({'ahead' if res['speedup'] > 1 else 'behind'}).")
        for ours, tps in (("autoregressive", res["baseline_tokens_per_s"]), ("DFlash", res["spec_tokens_per_s"])):
            for p in res.get("peers", []):
                if not p["skipped"]:
                    ratio = tps / p["tokens_per_s"]
                    lines.append(f"  - our {ours} vs {p['name']}: {ratio:.2f}x "
                                 f"({'ahead' if ratio > 1 else 'behind'}; {tps:.1f} vs {p['tokens_per_s']:.1f} tok/s)"
                                 + goal(ours, p["name"], ratio))
    return lines + [""]


GOALS = {("DFlash", "llama.cpp-dflash"): 1.5, ("DFlash", "zlab-reference"): 2.0}  # same draft, same prompts


def goal(ours: str, peer: str, ratio: float) -> str:
    target = GOALS.get((ours, peer))
    return "" if target is None else f"; goal >= {target:g}x: {'met' if ratio >= target else 'not met'}"


def chart(runs: list[tuple[str, dict]], out: str) -> None:
    """One group per run (prompt set x placement x temperature): tokens/s of both modes, and tau."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [name.replace("full_", "").replace(" (", "\n").rstrip(")").replace("_", "+") for name, _ in runs]
    base = [res["baseline_tokens_per_s"] for _, res in runs]
    spec = [res["spec_tokens_per_s"] for _, res in runs]
    taus = [res["tau"] for _, res in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 1.7 * len(runs)), 4.5))
    x = list(range(len(labels)))
    ax1.bar([i - 0.2 for i in x], base, 0.4, label="autoregressive")
    ax1.bar([i + 0.2 for i in x], spec, 0.4, label="DFlash")
    ax1.set_ylabel("tokens/s")
    ax1.legend()
    ax2.bar(x, taus, 0.5, color="tab:green")
    ax2.set_ylabel("tau (tokens per verify step)")
    for ax in (ax1, ax2):
        ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# ---- the whole page: one section per kind of result, each from the files listed here ----

SOURCES = {
    "decode": ["decode/chat_r1.json", "decode/chat_r2.json", "decode/chat_r3.json",
               "decode/humaneval_r1.json", "decode/humaneval_r2.json", "decode/humaneval_r3.json"],
    "emulated": ["decode/ane_sim_chat.json"],
    "field": ["field/humaneval.json"],
    "grammar": ["costs/grammar_engines.json", "decode/json_schema.json"],
    "costs": ["costs/costs_r1.json", "costs/costs_r2.json", "costs/costs_r3.json"],
    "prefill": ["costs/prefill_rate.json"],
    "mlx": ["costs/mlx_eager.json", "costs/mlx_compiled.json"],
    "agreement": ["agreement/llama_agreement.json"],
    "heldout": ["heldout/block2.json", "heldout/block2_lookup.json", "heldout/block8.json", "heldout/block2_4layer.json"],
    "controller": ["controller/replay.json"],
    "serving": ["serving/server_load.json", "serving/prefix_cache_ttft.json"],
    "chat": ["chat/chat_speed.json"],
    "acceptance": ["acceptance/chat_host.json", "acceptance/chat_device.json", "acceptance/humaneval_host.json",
                   "acceptance/humaneval_device.json"],
    "training": ["training/b8g2-curve.json", "training/b8g2-block2-curve.json", "training/e1-curve.json",
                 "training/e1-block2-curve.json", "training/e2-curve.json", "training/e2-block2-curve.json"],
    "throughput": ["training/throughput_float32.json", "training/throughput_bf16.json"],
}
# The runs of the shipped draft's chain (docs/training.md), in order, by their curve files' prefix.
TRAINING_RUNS = {"b8g2": "D (block 8, from the block-16 run)", "e1": "E1 (from D@20320)", "e2": "E2 (from E1@14000, both stores)"}
SHIPPED = ("e2", 20700)
# Draft names in eval_heldout.py's JSON that are folders of a run rather than a name a user loads.
HELDOUT_LABELS = {"cpu-trained": "`cpu-trained` (shipped)", "ngram_floor": "1-3-gram table (no features)"}


def table(*columns: str) -> list[str]:
    """A Markdown table's header row and separator row."""
    return ["|" + "|".join(f" {c} " if c else " " for c in columns) + "|", "|" + "|".join(" --- " for _ in columns) + "|"]


def rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def date_of(path: Path, doc: dict | None = None) -> str:
    """The JSON's own date, else the day its content first entered git, else today (not committed yet)."""
    for key in ("date_utc", "date", "measured"):
        if doc and isinstance(doc.get(key), str) and re.match(r"\d{4}-\d\d-\d\d", doc[key]):
            return doc[key][:10]
    blob = subprocess.run(["git", "hash-object", str(path)], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    first = subprocess.run(["git", "log", "--all", "--reverse", "--format=%cs", f"--find-object={blob}"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    return first[0] if first else datetime.date.today().isoformat()


def machine_of(doc: dict) -> str:
    """'CPU model (capability), N cores[, GPU]' from whichever shape of machine record the JSON has."""
    if "runs" in doc:
        doc = doc["runs"][0]
    m = doc.get("machine") or {}
    cpu = ((doc.get("models") or {}).get("cost_key") or {}).get("cpu") or (doc.get("costs") or {}).get("cpu")
    if cpu is None and "lscpu" in doc:
        flags = [f for f, on in doc["lscpu"]["flags"].items() if on and ("512" in f or "amx" in f)]
        cpu = doc["lscpu"]["model"] + (f" ({', '.join(flags)})" if flags else " (AVX2)")
        m = {"cores": doc["lscpu"]["cpus"], **m}
    if cpu is None:
        cpu = m.get("cpu") or doc.get("cpu") or "?"
        cap = m.get("capability") or doc.get("torch_cpu_capability")
        cpu += f" ({cap})" if cap else ""
    cores = m.get("cores") or m.get("cpus")
    gpu = m.get("cuda") or doc.get("device") if (m.get("cuda") or str(doc.get("device", "")).startswith("NVIDIA")) else None
    return f"{cpu}, {cores} cores" + (f", {gpu}" if gpu else "") if cores else cpu


def command_of(doc: dict, path: Path) -> str:
    """The command that wrote the file, with its output path as the file is named now."""
    cmd = doc.get("command") or (doc.get("runs") or [{}])[0].get("command") or ""
    cmd = re.sub(r"(--json|--out)\s+\S+", lambda mt: f"{mt.group(1)} {rel(path)}", cmd)
    return re.sub(r"^\S*/(hetero-sd|python)\b", r"\1", cmd).replace("/work/main/", "")


def source_line(path: Path, doc: dict) -> str:
    return f"Source: `{rel(path)}` ({machine_of(doc)}; {date_of(path, doc)})."


def read(name: str) -> tuple[Path, dict]:
    path = RESULTS / name
    return path, json.loads(path.read_text())


def decode_section() -> list[str]:
    lines = ["## Decoding: the default pair, default flags", "",
             "`hetero-sd bench --dataset SET --limit 6 --max-new-tokens 128 --temperature 0,1 --seed RUN` (`bash benchmarks/decode.sh`; "
             "each run its own seed, so the T=1 rows are three samples of answers): "
             "SmolLM2-135M-Instruct with the shipped `cpu-trained` draft, both on the CPU, the block-size controller on; "
             "plain and speculative decoding alternate prompt by prompt in one process. Lossless at T=0 means every "
             "output token-identical to plain decoding's; at T=1 the outputs are samples (their distribution is the "
             "target's, tested statistically in the test suite).", "",
             *table("file", "machine", "date", "set", "T", "plain tok/s", "hetero-sd tok/s", "speedup", "tau", "lossless", "target plan")]
    for name in SOURCES["decode"]:
        path, doc = read(name)
        for res in doc["runs"]:
            s = res["settings"]
            lossless = {True: "yes", False: "**no**", None: "(T>0)"}[res["lossless"]]
            lines.append(f"| `{rel(path)}` | {machine_of(doc)} | {date_of(path, doc)} | {path.stem.split('_')[0]} | "
                         f"{s['temperature']:g} | {res['baseline_tokens_per_s']:.0f} | {res['spec_tokens_per_s']:.0f} | "
                         f"{res['speedup']:.2f}x | {res['tau']:.2f} | {lossless} | {res['models'].get('weight_plan', '-')} |")
    lines += ["", "tau: tokens per verify step, the bonus token included. Absolute tok/s of a 2-core VM move by "
              "10-30% from minute to minute; the speedup is measured within one run. The target plan column says "
              "how each run kept its K/V cache.", ""]
    for name in SOURCES["emulated"]:
        path, doc = read(name)
        res = doc.get("runs", [doc])[0]
        lines += ["### The draft on `ane-sim` (emulated)", "",
                  f"`{command_of(doc, path)}`: plain {res['baseline_tokens_per_s']:.0f} tok/s, hetero-sd "
                  f"{res['spec_tokens_per_s']:.0f} tok/s ({res['speedup']:.2f}x), lossless: {res['lossless']}. `ane-sim` runs "
                  "the Neural Engine graph with every op rounded to fp16 on the CPU: its acceptance and drift are "
                  "meaningful, its speed says nothing about the Neural Engine.", ""]
        if res.get("drift") and res["drift"].get("tau_ratio") is not None:
            d = res["drift"]
            lines += [f"Drift against the float32 draft on the same prompts: tau ratio {d['tau_ratio']:.3f}, cosine "
                      f"{d['cosine']:.6f} (min {d['cosine_min']:.6f}), top-1 agreement {d['top1_agreement']:.1%}, "
                      f"KL {d['kl']:.1e}.", ""]
        lines += [source_line(path, doc), ""]
    return lines


def field_section() -> list[str]:
    lines = ["## The field on our draft", "",
             "llama.cpp's own DFlash (`llama.cpp-dflash`) and z-lab's reference loop (`zlab-reference`) run our draft "
             "on the same prompts and token ids, with llama.cpp's autoregressive decoding beside them "
             "(`bash benchmarks/field.sh`): our draft converted by `hetero-sd export-draft --to gguf` for llama.cpp, "
             "read as it is by z-lab's loader.", ""]
    for name in SOURCES["field"]:
        path, doc = read(name)
        for run_name, res in load([str(path)]):
            body = run_section(run_name, res)
            lines += [f"### {rel(path)}", "", f"Command: `{command_of(doc, path)}`", ""] + body[4:]
            lines += verdict([(run_name, res)])[2:]
        lines += [source_line(path, doc), ""]
    return lines


def grammar_section() -> list[str]:
    """JSON-schema output: the grammar engines' mask cost at the default vocabulary, then the default pair with
    and without a schema (benchmarks/json_schema_bench.py)."""
    engines_path, engines = read(SOURCES["grammar"][0])
    decode_path, decode = read(SOURCES["grammar"][1])
    lines = ["## Constrained output (JSON schemas)", "",
             f"Mask cost per token of each grammar engine on {engines['tokenizer']}'s {engines['vocab_size']:,}-token "
             f"vocabulary, {engines['threads']} thread (`python benchmarks/json_schema_bench.py`):", "",
             *table("engine", "version", "mean mask us/token", "exact on every schema")]
    for name, e in engines["engines"].items():
        runs = list(e.get("schemas", {}).values())
        if not runs:
            continue
        mean = sum(r["mask_us_per_token"] for r in runs) / len(runs)
        lines.append(f"| {name} | {e.get('version', '-')} | {mean:.1f} | {all(r.get('exact') for r in runs)} |")
    lines += ["", source_line(engines_path, engines), ""]
    sm = decode["summary"]
    lines += [f"The default pair on {len(decode['tasks'])} extraction prompts, T=0, {decode['max_new_tokens']} new "
              f"tokens, block {decode['block']} (`python benchmarks/json_schema_bench.py --decode`):", "",
              *table("output", "plain tok/s", "DFlash tok/s", "speedup", "tau", "equal to plain decoding")]
    for kind in ("free", "json"):
        r = sm[kind]
        lines.append(f"| {'free text' if kind == 'free' else 'JSON schema'} | {r['plain_tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['tau']:.2f} | {r['equal_to_plain']} |")
    lines += ["", f"With the schema: {sm['json']['valid']} answers validate (the others hit the token limit); the "
              f"grammar's masks cost {sm['json']['mask_ms_per_token']:.2f} ms a token.", "",
              source_line(decode_path, decode), ""]
    return lines


def costs_section() -> list[str]:
    lines = ["## Step costs against their floors", "",
             "`hetero-sd bench --costs`: the default target's decode step, its verify of k tokens and the draft's block "
             "of b, at 512 tokens of context, each in ms and in decode steps; the decode step's floor is the bytes it "
             "must read at the bus speed measured in the same run.", "",
             *table("file", "machine", "date", "bus GB/s", "decode ms", "of its floor", "verify 2 / 4 / 8 / 16 (decode steps)", "draft 2 / 4 / 8 (decode steps)")]
    for name in SOURCES["costs"]:
        path, doc = read(name)
        c = doc["costs"]
        d = c["decode_s"]
        verify = " / ".join(f"{c['verify_s'][k] / d:.2f}" for k in ("2", "4", "8", "16") if k in c["verify_s"])
        draft = " / ".join(f"{c['draft_s'][k] / d:.2f}" for k in ("2", "4", "8") if k in c["draft_s"])
        lines.append(f"| `{rel(path)}` | {machine_of(doc)} | {date_of(path, doc)} | {c['bandwidth_gbs']:.1f} | {d * 1e3:.2f} | "
                     f"{d / c['floors_s']['decode']:.2f}x | {verify} | {draft} |")
    lines.append("")
    lines += mlx_costs()
    for name in SOURCES["prefill"]:
        path, doc = read(name)
        pr, dec = doc["prefill_tokens_per_s"], doc["decode_step_ms_after_prompt"]
        lines += ["### Prompt processing and the decode step against llama.cpp", "",
                  f"`{command_of(doc, path)}` (llama.cpp: {doc['llama_cpp']}, same GGUF, same tokens, same threads):", "",
                  *table("", "prompt tokens/s", "decode step after the prompt (ms)")]
        for k in pr:
            lines.append(f"| {'our ' + k + ' target' if k != 'llama.cpp' else 'llama.cpp'} | {pr[k]:.0f} | {dec[k]:.2f} |")
        lines += ["", source_line(path, doc), ""]
    return lines


def mlx_costs() -> list[str]:
    """MLX's eager and mx.compile steps on MLX's Linux CPU build: a relative timing, not a speed."""
    lines = ["### MLX's steps, eager and compiled (MLX's Linux CPU build: a check, not a speed)", "",
             "`HETERO_SD_STEPS=eager|fixed hetero-sd bench --costs --target-device mlx --draft-device mlx`, the "
             "default pair in float32, one run each, one after the other. The compiled steps pad rows to a bucket and "
             "attend over a tier of slots, a fixed shape for `mx.compile`; on a CPU that padding costs more than the "
             "dispatch it saves, so `auto` compiles only on Metal. The floors are MLX's own: its read bandwidth and "
             "matmul peak measured through MLX (its CPU build's kernels are far slower than torch's).", "",
             *table("file", "machine", "date", "steps", "MLX read GB/s", "MLX GFLOPS", "decode ms", "of its floor",
                    "verify 16 ms", "draft 8 ms")]
    runs = [read(name) for name in SOURCES["mlx"]]
    for path, doc in runs:
        c = doc["costs"]
        lines.append(f"| `{rel(path)}` | {machine_of(doc)} | {date_of(path, doc)} | {doc['models']['steps']['target']} "
                     f"| {c['bandwidth_gbs']:.1f} | {c['peak_gflops']:.1f} | {c['decode_s'] * 1e3:.1f} | "
                     f"{c['decode_s'] / c['floors_s']['decode']:.2f}x | {c['verify_s']['16'] * 1e3:.0f} | "
                     f"{c['draft_s']['8'] * 1e3:.1f} |")
    (_, eager), (_, compiled) = runs
    ratio_ = compiled["costs"]["decode_s"] / eager["costs"]["decode_s"]
    return lines + ["", f"Compiled against eager, decode step: {ratio_:.2f}x the time.", ""]


def agreement_section() -> list[str]:
    lines = ["## Agreement with llama.cpp", "",
             "Our int8 target against llama.cpp on the same GGUF, greedy, 128 tokens per prompt "
             "(`python benchmarks/llama_agreement.py`): where the two first differ, and whether it is at a near-tie "
             "(llama.cpp took our second choice).", "",
             *table("file", "our target", "prompts", "identical", "median first divergence (token)", "divergences at our second choice", "median top-2 margin there")]
    for name in SOURCES["agreement"]:
        path, doc = read(name)
        for variant, sm in doc["summary"].items():
            firsts = sorted(sm["first_divergences"])
            median = (firsts[(len(firsts) - 1) // 2] + firsts[len(firsts) // 2]) / 2
            lines.append(f"| `{rel(path)}` | {variant} | {sm['prompts']} | {sm['exact_match']} | {median:g} | "
                         f"{sm['divergences_at_our_second_choice']} of {sm['prompts']} | {sm['median_top2_margin_at_divergence']:.3f} |")
        lines += ["", source_line(path, doc) + f" llama.cpp: {doc['llama_cpp']}, K cache {doc.get('llama_cpp_k_cache', 'f16')}.", ""]
    return lines


def heldout_section() -> list[str]:
    lines = ["## Held-out acceptance of the shipped draft", "",
             "Simulated greedy decoding on the 256 held-out self-distillation rows no training run used (154 chat, 102 "
             "code; `python benchmarks/eval_heldout.py --draft cpu-trained --block-size B [--lookup 0.4]`): each row's "
             "first 64 answer tokens, a block accepting its leading tokens equal to the target's answer. Position 1: "
             "how often the first drafted token is right.", "",
             *table("file", "draft", "block", "lookup", "chat tau", "chat position 1", "code tau", "code position 1")]
    for name in SOURCES["heldout"]:
        path, doc = read(name)
        for key, v in doc.items():
            if not (isinstance(v, dict) and "sharegpt" in v):
                continue
            if "4layer" in path.stem and key == "cpu-trained":
                continue  # the shipped draft's row of that file repeats block2.json's
            label = HELDOUT_LABELS.get(key, "4-layer draft trained on an H200 (not shipped)" if "4layer" in path.stem else f"`{key}`")
            if key == "ngram_floor" and name != SOURCES["heldout"][0]:
                continue
            lines.append(f"| `{rel(path)}` | {label} | {doc['block_size']} | {doc.get('lookup') or '-'} | "
                         f"{v['sharegpt']['tau']:.3f} | {v['sharegpt']['position_1_right']:.1%} | {v['stdlib']['tau']:.3f} | "
                         f"{v['stdlib']['position_1_right']:.1%} |")
    dates = ", ".join(f"`{n}` {date_of(RESULTS / n, json.loads((RESULTS / n).read_text()))}" for n in SOURCES["heldout"])
    return lines + ["", "Acceptance depends on the draft and the target's numerics, not on the machine's speed. "
                    f"Computed on 2-core AMD EPYC CPUs from the float32 target's features; dates: {dates}.", ""]


def controller_section() -> list[str]:
    lines = ["## The block-size controller replayed", "",
             "`python benchmarks/controller_replay.py`: the draft's real acceptance recorded at every position of plain "
             "greedy decoding, then replayed without the models at measured step costs: tokens per decode step's "
             "time for plain decoding, fixed blocks, `auto` and the optimum (a dynamic program that knows every "
             "acceptance). Modelled, not timed: it compares policies. \"Verified as far as the draft is confident\": "
             "`auto`'s blocks, each verified only up to the prefix with the most expected tokens per second when the "
             "draft's probabilities are taken as the chance that each draft is right.", ""]
    for name in SOURCES["controller"]:
        path, doc = read(name)
        sets = doc["sets"]
        policies = list(next(iter(sets.values()))["tokens_per_decode_step"])
        lines += table("policy", *sets)
        for pol in policies:
            lines.append(f"| {pol} | " + " | ".join(f"{sets[s]['tokens_per_decode_step'][pol]:.3f}" for s in sets) + " |")
        lines += ["", source_line(path, doc) + f" Draft: `{Path(doc['draft']).name}` ({doc['draft_format']}); "
                  f"step costs from `{Path(doc['costs_from']).name}`.", ""]
    return lines


def serving_section() -> list[str]:
    lines = ["## Serving", ""]
    path, doc = read(SOURCES["serving"][0])
    lines += [f"`python benchmarks/server_load.py`: `hetero-sd serve` (default model and draft) under {doc['clients']} "
              f"clients x {doc['requests_per_client']} streamed requests of up to {doc['max_tokens']} tokens at T=0: "
              f"{doc['completed']}/{doc['requests']} complete, {doc['errors']} errors, latency p50 {doc['latency_p50_s']:.1f} s / "
              f"p95 {doc['latency_p95_s']:.1f} s, time to first token p50 {doc['ttft_p50_s']:.1f} s / p95 {doc['ttft_p95_s']:.1f} s "
              f"(most of it queueing), {doc['tokens_per_s']:.0f} tokens/s in all; exit status "
              f"{doc.get('server_exit_status_after_sigterm')} after SIGTERM. Load average {doc['machine'].get('loadavg_1m', 0):.0f} "
              "during the run (a shared machine): what the server does under load, not what the CPU does quietly.", "",
              source_line(path, doc), ""]
    path, doc = read(SOURCES["serving"][1])
    t = doc["ttft_median_s"]
    lines += [f"`python benchmarks/prefix_cache_ttft.py`: the fifth turn of a conversation ({doc['prompt_tokens']} prompt "
              f"tokens, {doc['cached_tokens'][0]} reused), time to first token {t['without']:.2f} s without the prefix cache "
              f"and {t['with']:.2f} s with it (medians of {len(doc['runs']['with'])}; {doc['speedup']:.1f}x).", "",
              f"Source: `{rel(path)}` ({machine_of(doc) if 'machine' in doc else '2-core AMD EPYC'}; {date_of(path, doc)}).", ""]
    return lines


def chat_section() -> list[str]:
    path, doc = read(SOURCES["chat"][0])
    m, rounds = doc["median"], doc["rounds"]
    lines = ["## The chat app against `generate`", "",
             f"`python benchmarks/chat_speed.py`: each round runs `hetero-sd generate` on \"{doc['prompt']}\" "
             f"({doc['max_new_tokens']} tokens, default model and draft), the same with `--autoregressive`, then "
             f"`hetero-sd chat` with the same question, each in a {doc['window']} tmux window (the chat's panel read "
             f"from the screen). Medians of {len(rounds)} rounds' ratios: the chat's tok/s over generate's "
             f"**{doc['chat_over_generate']:.2f}x**, its shown speedup over generate's spec/AR ratio "
             f"**{doc['shown_speedup_over_generate_speedup']:.2f}**. Medians of the rates: chat {m['chat_tok_s']:.0f} "
             f"tok/s, generate {m['generate_tok_s']:.0f}; shown speedup {m['chat_speedup']:.2f}x (over the chat's "
             f"baseline, {m['chat_baseline_tok_s']:.0f} tok/s), generate's {m['generate_speedup']:.2f}x "
             f"(AR {m['generate_ar_tok_s']:.0f} tok/s).", "",
             *table("round", "generate tok/s", "AR tok/s", "chat tok/s", "chat / generate", "shown speedup",
                    "generate spec/AR", "chat baseline tok/s", "screen thread CPU s")]
    for i, (r, p) in enumerate(zip(rounds, doc["per_round"]), 1):
        g, a, c = r["generate"], r["generate_ar"], r["chat"]
        lines.append(f"| {i} | {g['tok_s']:.0f} | {a['tok_s']:.0f} | {c['tok_s']:.0f} | {p['chat_over_generate']:.2f} | "
                     f"{c['speedup']:.2f}x | {p['generate_speedup']:.2f}x | {c['baseline_tok_s']:.0f} | "
                     f"{c['cpu_s_during_answer']['screen_thread']:.2f} |")
    tau = sorted({round(r[k]["tau"], 2) for r in rounds for k in ("generate", "chat")})
    return lines + ["", f"tau {tau[0]:.2f}" + (f"-{tau[-1]:.2f}" if tau[-1] != tau[0] else "") + " on both sides. The screen thread's CPU time is from Enter "
                    "until the panel said `done` (10 ms ticks).", "", source_line(path, doc), ""]


def acceptance_section() -> list[str]:
    """The context lookup steering proposals on the device (along its own path) against on the host (exactly)."""
    lines = ["## Acceptance on the device: the context lookup's steering", "",
             "A block accepted on the device is read by the host once; the context lookup then steers the proposals "
             "along its own path only, where the host looks up its guesses after every proposal "
             "(docs/decoding.md). The cost in tau, the default pair with fixed blocks, the acceptance forced each way "
             "on the CPU (`auto` keeps it on the host there; on a GPU the device's one read is what it buys):", "",
             *table("set", "acceptance", "tau", "proposals the lookup changed", "blocks", "T=0 output identical")]
    docs = [read(name) for name in SOURCES["acceptance"]]
    for path, doc in docs:
        lookup = doc["schedules"][0]["lookup"]
        dataset, where = path.stem.split("_")
        lines.append(f"| {dataset} | {where} | "
                     f"{doc['tau']:.3f} | {lookup['drafts_changed']} | {lookup['verified_blocks']} | "
                     f"{'yes' if doc['lossless'] else '**no**'} |")
    path, doc = docs[0]
    return lines + ["", f"`{command_of(doc, path)}` (and `--acceptance device`, `--dataset humaneval`). "
                    + source_line(path, doc), ""]


def training_section() -> list[str]:
    lines = ["## Training the shipped draft", "",
             "The learning curve of the chain that made `cpu-trained` (docs/training.md), by held-out simulated "
             "decoding (as above, on each run's snapshot with the full head) at every evaluated step: blocks trained "
             "and CPU-hours since the run's start.", "",
             *table("run", "step", "date", "blocks trained", "CPU-hours", "block 2: chat / code position 1", "block 8: chat / code tau")]
    for run, label in TRAINING_RUNS.items():
        eight = {p["step"]: p for p in json.loads((RESULTS / "training" / f"{run}-curve.json").read_text())["points"]}
        two = {p["step"]: p for p in json.loads((RESULTS / "training" / f"{run}-block2-curve.json").read_text())["points"]}
        for step in sorted(set(eight) | set(two)):
            p = eight.get(step) or two[step]
            b2 = two.get(step)
            b8 = eight.get(step)
            cell2 = f"{b2['simulated']['sharegpt']['position_1_right']:.1%} / {b2['simulated']['stdlib']['position_1_right']:.1%}" if b2 else "-"
            cell8 = f"{b8['simulated']['sharegpt']['tau']:.3f} / {b8['simulated']['stdlib']['tau']:.3f}" if b8 else "-"
            mark = "**" if (run, step) == SHIPPED else ""
            lines.append(f"| {label} | {mark}{step}{mark} | {p.get('date_utc', '-')[:10]} | {p['blocks_trained']:,} | "
                         f"{p['cpu_hours']:.2f} | {cell2} | {cell8} |")
    floor = json.loads((RESULTS / "training" / "e2-curve.json").read_text())["points"][-1]["ngram_floor"]
    lines += ["", f"The 1-3-gram table on the same rows: block 8 chat / code tau {floor['sharegpt']['tau']:.3f} / "
              f"{floor['stdlib']['tau']:.3f}. Shipped: **E2 step {SHIPPED[1]}**. Run D trained on a 2-core AMD EPYC "
              "with AVX2 only (float32), E1 and E2 on a 2-core AMD EPYC Zen 5 (bf16 autocast). Sources: "
              + ", ".join(f"`benchmarks/results/{n}`" for n in SOURCES["training"]) + ".", "",
              "### Training throughput", "",
              "`python benchmarks/train_throughput.py`: draft blocks trained per CPU-second by the trainer's own step "
              "loop (run D's recipe, block 8, features read from disk).", "",
              *table("file", "machine", "date", "numerics", "blocks per CPU-second")]
    for name in SOURCES["throughput"]:
        path, doc = read(name)
        numerics = "bf16 autocast" if "bf16" in path.stem else "float32"
        lines.append(f"| `{rel(path)}` | {machine_of(doc)} | {date_of(path, doc)} | {numerics} | {doc['blocks_per_cpu_s']:.1f} |")
    return lines + [""]


GPU_CHECK = ("gpu/gpu_check.json", "gpu_check.json")  # benchmarks/gpu_check.py's output, where it was committed


def gpu_goals(doc: dict) -> list[str]:
    """The accelerator path's goals, each against what the check measured (a row it did not measure: '-'): step
    costs per shape, the loop against its own costs' prediction, the host CPU's draft beside the GPU's."""
    shapes, e2e = doc.get("shapes", {}), doc.get("e2e", {})
    rows = []

    def goal(what: str, value, limit: float, below: bool, fmt: str = "{:.2f}") -> None:
        met = "-" if value is None else ("yes" if (value <= limit if below else value >= limit) else "**no**")
        rows.append(f"| {what} | {'-' if value is None else fmt.format(value)} | {'<=' if below else '>='} "
                    f"{fmt.format(limit)} | {met} |")

    def oracle(shape: str, place: str, schedule: str) -> dict:
        return e2e.get(f"{shape}/oracle-full-b8/{place}/{schedule}/graphs", {})

    goal("qwen3-4b: decode step, x its floor", shapes.get("qwen3-4b", {}).get("decode_x_floor"), 1.3, True)
    goal("smollm2-135m: decode step, ms", shapes.get("smollm2-135m", {}).get("decode_ms"), 1.5, True)
    for name, res in shapes.items():
        goal(f"{name}: verify of 16, decode steps", res.get("verify_x_decode", {}).get("16"), 1.15, True)
        goal(f"{name}: draft block of 8, decode steps", res.get("draft_x_decode", {}).get("8"), 0.15, True)
    places = {k.split("/")[2] + "/" + k.split("/")[3] for k in e2e if "/oracle-" in k}
    gpu = next((p for p in sorted(places) if p.split("/")[0] == p.split("/")[1]), None)  # (e.g. cuda/cuda)
    host = next((p for p in sorted(places) if p.endswith("/cpu") and p != gpu), None)  # (cuda/cpu)
    for name in (n for n in shapes if any(k.startswith(f"{n}/oracle-") for k in e2e)):
        goal(f"{name}: oracle block 8 (full acceptance, graphs), of its costs' prediction",
             oracle(name, gpu, "sequential").get("of_prediction") if gpu else None, 0.9, False)
        ours, beside = oracle(name, gpu, "sequential").get("tok_s"), oracle(name, host, "overlap").get("tok_s")
        goal(f"{name}: the host CPU's draft (overlap) against the GPU's (sequential), tok/s",
             beside / ours if ours and beside else None, 1.0, False)
    return ["Against the goals (the pair's goals against HF generate and z-lab's loop are the pair's benches):", "",
            *table("goal", "measured", "goal", "met"), *rows]


def gpu_section(path: Path | None = None) -> list[str]:
    """The accelerator check (benchmarks/gpu_check.py), when its JSON is committed: step costs per model shape
    against the device's floors, then tokens/s end to end (oracle drafts: full or set acceptance)."""
    if path is None:
        path = next((RESULTS / n for n in GPU_CHECK if (RESULTS / n).is_file()), None)
        if path is None:
            return []
    doc = json.loads(path.read_text())
    date = (doc.get("started") or "")[:10] or date_of(path, doc)
    lines = ["## On a GPU", "",
             f"`python3 benchmarks/gpu_check.py` on {doc['device']} (host {doc['host_cpu']}; torch {doc['torch']}, CUDA "
             f"{doc.get('cuda') or '-'}; {date}): random weights of each model's shape in {doc['dtype']}, "
             f"{doc['context']} tokens of context. Step costs, in ms and in decode steps:", "",
             *table("shape", "steps", "decode ms", "of its floor", "verify 8 / 16 (decode steps)", "draft 8 / 16 (decode steps)",
                    "catch-up 8 / 16 (decode steps)", f"prefill of {doc.get('prompt', '-')} ms", "warm-up s")]
    for shape, res in doc["shapes"].items():
        # the headline mode's row, then each other mode's (eager, compiled: dicts of their own)
        for row in (res, *(v for v in res.values() if isinstance(v, dict) and "decode_ms" in v)):
            if "decode_ms" not in row:
                continue
            floor = res.get("floor_ms")
            v, d, c = row.get("verify_x_decode", {}), row.get("draft_x_decode", {}), row.get("context_ms", {})
            dm = row["decode_ms"]
            prefill = f"{row['prefill_ms']:.2f}" if "prefill_ms" in row else "-"
            warm = f"{row['warm_s']:.1f}" if "warm_s" in row else "-"
            x_floor = "-" if not floor else f"{row['decode_ms'] / floor:.2f}x"
            lines.append(f"| {shape} | {row.get('mode', row.get('steps'))} | {row['decode_ms']:.2f} | {x_floor} | "
                         f"{' / '.join(f'{v[k]:.2f}' for k in ('8', '16') if k in v) or '-'} | "
                         f"{' / '.join(f'{d[k]:.2f}' for k in ('8', '16') if k in d) or '-'} | "
                         f"{' / '.join(f'{c[k] / dm:.2f}' for k in ('8', '16') if k in c) or '-'} | {prefill} | "
                         f"{warm} |")
    lines += ["", f"End to end, {doc['new_tokens']} new tokens: an oracle draft runs every block (its cost is paid) and "
              "its proposals are the target's own greedy continuation (all right, or the first two right); "
              "`tok/s` is end to end (the prompt's prefill included), `decode tok/s` the rate after the first token "
              "(vLLM's 1 / TPOT). `of prediction` is decode tok/s over what the step costs predict "
              "(tau / (context catch-up + draft + verify)), end-to-end tok/s over it in brackets.", "",
              *table("row", "tok/s", "decode tok/s", "tau", "vs autoregressive", "identical to autoregressive",
                     "of prediction")]
    for name, row in doc["e2e"].items():
        speed = row.get("speedup_vs_ar")
        same = {True: "yes", False: "**no**"}.get(row.get("identical_to_ar"), "-")
        share, e2e_share = row.get("of_prediction"), row.get("of_prediction_e2e")
        decode = row.get("decode_tok_s")
        lines.append(f"| {name} | {row['tok_s']:.1f} | {'-' if decode is None else f'{decode:.1f}'} | {row['tau']:.2f} | "
                     f"{'-' if speed is None else f'{speed:.2f}x'} | {same} | {'-' if share is None else f'{share:.2f}'}"
                     f"{'' if e2e_share is None else f' ({e2e_share:.2f})'} |")
    lines += ["", *gpu_goals(doc)]
    if doc.get("skipped"):
        lines += ["", "Skipped (time budget): " + "; ".join(doc["skipped"]) + "."]
    if doc.get("errors"):
        lines += ["", "Errors: " + "; ".join(doc["errors"]) + "."]
    return lines + ["", f"Source: `{rel(path)}`.", ""]


def whole_page() -> list[str]:
    lines = ["# Results", "",
             "Generated by `python benchmarks/results_md.py` from the JSON under `benchmarks/results/` that each "
             "section names; every figure is read from those files. Each names its machine and date. How to "
             "re-run each: [README.md](README.md).", "",
             "Contents: [decoding](#decoding-the-default-pair-default-flags), "
             "[the field](#the-field-on-our-draft), [constrained output](#constrained-output-json-schemas), "
             "[step costs](#step-costs-against-their-floors), "
             "[agreement with llama.cpp](#agreement-with-llamacpp), "
             "[held-out acceptance](#held-out-acceptance-of-the-shipped-draft), "
             "[controller replay](#the-block-size-controller-replayed), [serving](#serving), "
             "[the chat app](#the-chat-app-against-generate), "
             "[acceptance on the device](#acceptance-on-the-device-the-context-lookups-steering), "
             "[training](#training-the-shipped-draft), [training throughput](#training-throughput).", ""]
    for section in (decode_section, field_section, grammar_section, costs_section, gpu_section, agreement_section, heldout_section,
                    controller_section, serving_section, chat_section, acceptance_section, training_section):
        lines += section()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", help="bench JSON files (default: every source of the whole page)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--chart", default=None, help="with bench JSON files: a PNG of tokens/s and tau per run")
    args = ap.parse_args()
    if not args.json:
        if args.chart:
            ap.error("--chart goes with bench JSON files; the whole page has no chart")
        Path(args.out).write_text("\n".join(whole_page()))
        print(f"wrote {args.out}")
        cited = {RESULTS / n for names in SOURCES.values() for n in names} | {RESULTS / n for n in GPU_CHECK}
        for path in sorted(p for p in RESULTS.rglob("*") if p.is_file() and p not in cited):
            print(f"note: {rel(path)} is cited by no section: add it to SOURCES in results_md.py, or delete it")
        return
    runs = load(args.json)
    lines = ["# Results", "", "Regenerated by `python benchmarks/results_md.py` from: " +
             ", ".join(f"`{p}`" for p in args.json) + ".", ""]
    lines += machine_section(runs)
    lines += ["Method: in each run our autoregressive baseline and DFlash alternate prompt by prompt; the peers",
              "then run the same token ids in the same process. Compare the ratios within a run: absolute tok/s",
              "of a shared machine move from minute to minute.", ""]
    for name, res in runs:
        lines += run_section(name, res)
    lines += verdict(runs)
    if args.chart:
        chart(runs, args.chart)
        lines += [f"![tokens/s and tau per prompt set, placement and temperature]({Path(args.chart).relative_to(Path(args.out).parent)})", ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
