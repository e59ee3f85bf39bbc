"""The Textual chat app (`hetero-sd chat`)."""

from .app import ChatApp

__all__ = ["ChatApp"]
