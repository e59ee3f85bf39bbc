"""Where hetero-sd keeps converted models: $HETERO_SD_HOME or ~/.cache/hetero-sd."""

import os
from pathlib import Path

from hetero_sd.errors import HomeError


def home() -> Path:
    """The home folder, created if missing; one that cannot be a folder is refused with a clear error."""
    given = os.environ.get("HETERO_SD_HOME")
    path = Path(given or os.path.join(Path.home(), ".cache", "hetero-sd")).expanduser()
    where = f"hetero-sd's home {path}" + (" (HETERO_SD_HOME)" if given else "")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise HomeError(f"{where} is a file, not a folder", "set HETERO_SD_HOME to a folder") from None
    except OSError as e:
        raise HomeError(f"{where} cannot be created ({e.strerror})",
                        "set HETERO_SD_HOME to a folder you can write to") from None
    if not path.is_dir():
        raise HomeError(f"{where} is not a folder", "set HETERO_SD_HOME to a folder")
    return path


def writable_home(purpose: str) -> Path:
    """The home, for work that writes to it (a first-time conversion, a compiled package)."""
    path = home()
    if not os.access(path, os.W_OK | os.X_OK):
        raise HomeError(f"hetero-sd's home {path} is read-only; {purpose} needs to write there",
                        "set HETERO_SD_HOME to a folder you can write to")
    return path
