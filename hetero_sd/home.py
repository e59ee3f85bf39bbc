"""Where hetero-sd keeps converted models: $HETERO_SD_HOME or ~/.cache/hetero-sd."""

import os
from pathlib import Path


def home() -> Path:
    root = os.environ.get("HETERO_SD_HOME") or os.path.join(Path.home(), ".cache", "hetero-sd")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
