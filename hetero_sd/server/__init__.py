"""`hetero-sd serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one shared Runtime.

Its names load on first use: importing a plain submodule (defaults.py, for the command line's flags) must not
pull in the web stack."""

from __future__ import annotations

__all__ = ["Settings", "create_app", "model_name", "serve"]


def __getattr__(name: str):
    if name in ("Settings", "create_app", "model_name"):
        from . import app
        return getattr(app, name)
    if name == "serve":
        from .run import serve
        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
