"""Device backends (shipped as hetero_sd.backends). Each family implements the two small interfaces in `base.py`;
`placement.py` picks the backend for a device."""
