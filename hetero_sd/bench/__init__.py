"""Benchmarking: the bench loop over prompts (`runner.py`), peers (llama.cpp, z-lab's reference, ...),
repetition loops in outputs, the bandwidth floor, placement sweeps."""
