"""hetero-sd: DFlash speculative decoding with the target and the draft on different accelerators."""

from .devices import DeviceInfo, devices
from .errors import HeteroSDError
from .runtime import DraftStep, Generation, Runtime, StreamEvent, load
from .stats import Stats

__all__ = ["load", "devices", "Runtime", "Generation", "StreamEvent", "DraftStep", "Stats", "DeviceInfo",
           "HeteroSDError"]
__version__ = "0.1.0"
