"""Device backends. Each family implements the two small interfaces in `backends.base`."""
