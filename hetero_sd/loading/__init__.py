"""Loading: where a model comes from (`sources.py`, the embedded default model), target/draft pairing,
and the loader that turns names into backends (`loader.py`)."""
