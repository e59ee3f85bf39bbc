"""The `hetero-sd` command: `main.py` parses and dispatches; `bench.py` is `hetero-sd bench`."""

from .main import main

__all__ = ["main"]
