"""Print a Chrome trace written by `hetero-sd bench --trace` as text: one bar row per device lane and
the share of time both were busy, per traced run. For a look without a browser (the file opens in
ui.perfetto.dev or chrome://tracing too).

    python benchmarks/trace_view.py trace.json [--match pipeline] [--width 100]
"""

from __future__ import annotations

import argparse
import json

from hetero_sd.decoding.timeline import Timeline, bars


def timelines(trace: dict) -> dict[str, Timeline]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    out = {pid: Timeline(origin=0.0) for pid in names}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            lane = "target" if e["tid"] == 1 else "draft"
            out[e["pid"]].record(lane, e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
    return {names[pid]: t for pid, t in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--match", default="", help="only runs whose name contains this")
    ap.add_argument("--width", type=int, default=80)
    args = ap.parse_args()
    for name, t in timelines(json.load(open(args.trace))).items():
        if args.match not in name:
            continue
        s = t.summary()
        print(f"{name}: {s['wall_s']:.2f} s, both busy {s['concurrent_s']:.2f} s, "
              f"draft time hidden {s['overlap_fraction']:.0%}")
        for lane in ("target", "draft"):
            print(f"  {lane:<6} |{bars(t.sparkline(lane, args.width), top=1.0)}|")


if __name__ == "__main__":
    main()
