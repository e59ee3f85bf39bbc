"""Device-placement experiments: every (target, draft, devices) combination under every schedule, on
the same prompts, each against its own autoregressive baseline measured in the same run.

    from .experiments import placement_sweep
    table = placement_sweep(drafts=["random:2", "random:4"], devices=[("cpu", "cpu")],
                            schedules=["sequential", "overlap", "pipeline"], prompts=["Hi!", "Explain rain."])
    table.print(); table.save("sweep.json")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

from .runner import machine, run_bench
from hetero_sd.prompts import Prompt, load_prompts
from hetero_sd.runtime import load

COLUMNS = ("target", "draft", "target_device", "draft_device", "schedule", "tokens_per_s", "baseline_tokens_per_s",
           "speedup", "tau", "overlap_fraction", "predraft_hit_rate", "draft_to_verify_cost", "drift", "lossless")


@dataclass
class SweepTable:
    rows: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="placement sweep")
        for col in COLUMNS:
            t.add_column(col.replace("_", " "), justify="right")
        for r in self.rows:
            t.add_row(*(fmt(r.get(c)) for c in COLUMNS))
        Console().print(t)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"machine": machine(), "settings": self.settings, "rows": self.rows}, f, indent=2)


def fmt(value) -> str:
    if isinstance(value, dict):  # drift (no figures where no draft block ran)
        if value.get("cosine") is None or value.get("tau_ratio") is None:
            return "no draft block ran"
        return f"cos {value['cosine']:.4f}, tau x{value['tau_ratio']:.3f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return "" if value is None else str(value)


def placement_sweep(targets: Sequence[str] = ("default",), drafts: Sequence[str] = ("default",),
                    devices: Sequence[tuple[str, str] | str] = (("cpu", "cpu"),),
                    schedules: Sequence[str] = ("sequential", "overlap"), prompts: Sequence[str] | None = None,
                    *, max_new_tokens: int = 128, temperature: float = 0.0, cpu_threads: int | None = None,
                    dtype=None) -> SweepTable:
    """One row per (target, draft, target device, draft device, schedule). `devices` holds pairs, or
    strings "target_device/draft_device". `prompts` default to the first 4 of the built-in chat set."""
    asked = [Prompt(p) for p in prompts] if prompts is not None else load_prompts(limit=4)
    table = SweepTable(settings=dict(max_new_tokens=max_new_tokens, temperature=temperature,
                                     prompts=[p.text for p in asked], schedules=list(schedules)))
    concurrent = next((s for s in schedules if s != "sequential"), "sequential")
    for target in targets:
        for draft in drafts:
            for pair in devices:
                target_device, draft_device = pair.split("/") if isinstance(pair, str) else pair
                rt = load(target, draft, target_device=target_device, draft_device=draft_device,
                          schedule=concurrent, cpu_threads=cpu_threads, dtype=dtype)
                try:
                    res = run_bench(rt, asked, max_new_tokens=max_new_tokens, temperature=temperature,
                                    schedules=schedules)
                finally:
                    rt.close()
                base = dict(target=target, draft=draft, target_device=rt.info["target_device"],
                            draft_device=rt.info["draft_device"], baseline_tokens_per_s=res["baseline_tokens_per_s"],
                            drift=res.get("drift"))
                for s in res["schedules"]:
                    table.rows.append(base | {k: s[k] for k in ("schedule", "speedup", "tau", "overlap_fraction",
                                                                "predraft_hit_rate", "draft_to_verify_cost",
                                                                "mean_verify_s", "mean_draft_s", "lossless")} | {"tokens_per_s": s["spec_tokens_per_s"]})
    return table
