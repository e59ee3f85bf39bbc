"""The Apple Neural Engine family: `ane-sim` (the fp16-safe draft graph with every op rounded to fp16,
on the CPU: an emulation, and labelled so everywhere) and, on macOS, Core ML devices."""

from .sim import AneSimDraft

__all__ = ["AneSimDraft"]
