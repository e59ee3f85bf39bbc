"""`hetero-sd serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one shared Runtime."""

from .app import Settings, create_app, model_name
from .run import serve

__all__ = ["Settings", "create_app", "model_name", "serve"]
