"""hetero-sd: DFlash speculative decoding with the target and the draft on different accelerators."""

from .devices import DeviceInfo, devices
from .errors import HeteroSDError
from .stats import Stats

__all__ = ["load", "devices", "Runtime", "Generation", "StreamEvent", "DraftStep", "Stats", "DeviceInfo",
           "HeteroSDError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The runtime imports the backends, and the backends import hetero_sd.config: resolving these names
    # on first use lets `import backends...` come first without a circular import.
    if name in ("load", "Runtime", "Generation", "StreamEvent", "DraftStep"):
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'hetero_sd' has no attribute {name!r}")
