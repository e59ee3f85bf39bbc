"""hetero-sd: DFlash speculative decoding with the target and the draft on different accelerators."""

from hetero_sd.decoding.stats import Stats
from hetero_sd.devices import DeviceInfo, devices
from hetero_sd.errors import HeteroSDError
from hetero_sd.runtime import DraftStep, Generation, Runtime, StreamEvent, load

__all__ = ["load", "devices", "Runtime", "Generation", "StreamEvent", "DraftStep", "Stats", "DeviceInfo",
           "HeteroSDError"]
__version__ = "0.1.0"
