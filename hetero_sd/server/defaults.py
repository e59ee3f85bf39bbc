"""The server's connection limits as the serve command shows them: plain values, importable without the server's
web stack (the command line builds every parser at start, and `hetero-sd bench` must run where FastAPI is absent)."""

MAX_BODY_BYTES = 16 * 1024 * 1024  # a 128k-token conversation is ~0.5 MB of JSON; 32x that leaves room
HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5.0  # uvicorn's default
