"""A server of this process on 127.0.0.1, for tests that talk HTTP to it."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from hetero_sd.server import Settings, create_app
from hetero_sd.server.run import config

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """uvicorn in a thread of this process (it installs no signal handlers off the main thread), so that its
    memory is this process's. With `header_timeout`, `hetero-sd serve`'s own configuration (server/run.py: the
    header timeout's protocol, keep-alive; its shutdown closes the runtime); without, the app alone on a plain
    uvicorn (the test's runtime stays open)."""

    def __init__(self, runtime, header_timeout: float | None = None, **settings):
        self.port = free_port()
        if header_timeout is None:
            self.app = create_app(runtime, Settings(MODEL, **settings))
            conf = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                  timeout_graceful_shutdown=5)
        else:
            conf = config(runtime, Settings(MODEL, **settings), port=self.port, log_level="warning",
                          header_timeout=header_timeout)
            self.app = conf.app
        self.server = uvicorn.Server(conf)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.engine

    def stop(self):
        self.server.should_exit = True
        self.thread.join(20)
