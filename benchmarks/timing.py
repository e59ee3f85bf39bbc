"""Wall-clock timing for the micro-benchmarks here (run as `python benchmarks/X.py`, which puts this folder on
sys.path): one warm-up call, then the best or the median of `reps` calls."""

from __future__ import annotations

import argparse
import statistics
import time


def times_of(f, reps: int) -> list[float]:
    f()  # warm-up: first-call allocation and kernel builds are not the steady cost
    out = []
    for _ in range(reps):
        began = time.perf_counter()
        f()
        out.append(time.perf_counter() - began)
    return out


def best(f, reps: int) -> float:
    return min(times_of(f, reps))


def median(f, reps: int) -> float:
    return statistics.median(times_of(f, reps))


def options(table: dict):
    """argparse from a table {flag: (type, default)}: the scripts' options without a copy of the same block."""
    ap = argparse.ArgumentParser()
    for flag, (kind, default) in table.items():
        ap.add_argument(flag, type=kind, default=default)
    return ap.parse_args()
