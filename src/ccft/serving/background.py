"""``BackgroundServer``: run an ASGI app with uvicorn in a background thread (tests, notebooks,
benchmarks)."""

from __future__ import annotations

import threading
import time

__all__ = ["BackgroundServer"]


class BackgroundServer:
    """Run an ASGI app with uvicorn in a background thread.

    ``port=0`` picks a free port; ``url`` is the base URL once started. Use as a context manager
    or call ``start()`` / ``stop()``. Extra keyword arguments go to ``uvicorn.Config``.

    Raises:
        ImportError: uvicorn is not installed (the ``serve`` extra).
    """

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", **uvicorn_kwargs
    ):
        from ccft.serving.extra import serve_extra_missing

        try:
            import uvicorn
        except ImportError as e:  # pragma: no cover - depends on the installation
            raise serve_extra_missing(e) from e

        self.config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="on", **uvicorn_kwargs
        )
        self.server = uvicorn.Server(self.config)
        self.thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        """Start serving; returns once the server listens (``timeout`` seconds at most).

        Raises:
            RuntimeError: the server did not start (the port is in use, or the app's startup failed).
        """
        self.thread = threading.Thread(target=self.server.run, name="ccft-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port} (port in use?)")
            time.sleep(0.02)
        sockets = [s for srv in getattr(self.server, "servers", []) for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the server to exit (the app's lifespan shutdown runs) and join its thread."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
            self.thread = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
