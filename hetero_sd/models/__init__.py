"""What a model folder holds: its config (`config.py`), the draft formats (`draft_format.py`), weights
(`weights.py`), and new draft folders (`draft_init.py`)."""
