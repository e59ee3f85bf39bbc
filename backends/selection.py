"""The DFlash2 block's type and `logits_of` live in the seam (backends/base.py); this module keeps their old
import path for code written against it."""

from .base import SelectorBlock, Walk, logits_of  # noqa: F401
