"""Decoding: the loops written once (`loop.py`), acceptance rules (`sampling.py`), the block-size
controller and its measured costs, device lanes, timelines and statistics."""
