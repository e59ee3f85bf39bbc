"""Regenerate benchmarks/RESULTS.md (and a PNG chart) from bench JSON files.

    python benchmarks/results_md.py benchmarks/results/full_*.json --out benchmarks/RESULTS.md \
        --chart benchmarks/results/full.png

Every figure in RESULTS.md comes from the JSON given; nothing is typed in by hand."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


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
             "| prompts | baseline tok/s | DFlash tok/s | speedup | tau | loop share | loop-free tau | loop-free speedup |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
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
    lines = ["| system | tok/s | tau | vs hetero-sd DFlash | vs hetero-sd autoregressive | loop share | "
             "of its decode floor | reads | note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
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


GOALS = {("DFlash", "llama.cpp-dflash"): 1.5, ("DFlash", "zlab-reference"): 2.0}  # issue 15: same draft, same prompts


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default="benchmarks/RESULTS.md")
    ap.add_argument("--chart", default=None)
    args = ap.parse_args()
    runs = load(args.json)
    lines = ["# Results", "", "Regenerated by `python benchmarks/results_md.py` from: " +
             ", ".join(f"`{p}`" for p in args.json) + ".", ""]
    lines += machine_section(runs)
    lines += ["Method: in each run our autoregressive baseline and DFlash alternate prompt by prompt; the peers",
              "then run the same token ids in the same process. This 2-core machine is noisy (two runs of the",
              "same set minutes apart can differ by ~30% in absolute tok/s), so compare the ratios within a run.", ""]
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
