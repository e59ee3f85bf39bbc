"""Running the app under uvicorn: loopback by default; SIGTERM and Ctrl-C stop taking requests, let the
ones in flight finish for up to `shutdown_s` seconds, then cancel them (their caches are freed) and exit."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import uvicorn

from .app import Settings, create_app
from .defaults import KEEP_ALIVE_S
from .limits import HEADER_TIMEOUT_S, timed_protocol


class Server(uvicorn.Server):
    """uvicorn's graceful shutdown, except that a generation still running shortly before the grace period
    ends is cancelled by us: its stream then ends with an error event and `data: [DONE]` instead of a
    connection cut mid-chunk, and its caches are freed."""

    async def shutdown(self, sockets=None) -> None:
        engine = self.config.app.state.engine
        grace = self.config.timeout_graceful_shutdown or 0.0
        asyncio.get_running_loop().call_later(max(grace - 1.0, 0.0), engine.cancel_all)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn re-raises the signal that stopped it once it has shut down (the process then dies of
        it); we exit with the project's statuses instead: 143 for SIGTERM, 130 for Ctrl-C."""
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", [])
            self.signalled = list(captured)
            captured.clear()

    @property
    def status(self) -> int:
        signalled = getattr(self, "signalled", [])
        return 0 if not signalled else 143 if signal.SIGTERM in signalled else 130


def config(runtime, settings: Settings, host: str = "127.0.0.1", port: int = 8000, shutdown_s: float = 10.0,
           log_level: str = "info", header_timeout: float = HEADER_TIMEOUT_S,
           keep_alive_timeout: float = KEEP_ALIVE_S) -> uvicorn.Config:
    """uvicorn on h11 (a request head still incomplete past 16 KiB is its 400) with the header timeout of
    limits.py, and its keep-alive timeout: an idle connection is closed after keep_alive_timeout seconds."""
    app = create_app(runtime, settings, close_runtime=True)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_s,
                          access_log=log_level == "debug", http=timed_protocol(header_timeout),
                          timeout_keep_alive=keep_alive_timeout)


def serve(runtime, settings: Settings, **kwargs) -> int:
    """Serve until SIGTERM or Ctrl-C; the exit status (0, or 143/130 after a signal's graceful shutdown)."""
    server = Server(config(runtime, settings, **kwargs))
    server.run()
    return server.status
