"""Run the HTTP service with uvicorn on 127.0.0.1; SIGINT/SIGTERM stop it cleanly.

uvicorn's own signal handling stops accepting connections and lets in-flight responses finish (up to
`grace_s`); the app's shutdown then closes the service: queued requests are refused, running ones are
cancelled, and the swap directory is removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging

from hetero.serve.service import Service

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


def bound_malloc() -> None:
    """Fix glibc's mmap threshold at 1 MiB: K/V buffers of finished requests go back to the OS at once.

    By default glibc raises the threshold after freeing large blocks, and later request buffers then
    come from the heap, which is rarely trimmed: RSS creeps up under a steady load.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(name)
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 1 << 20)


def make_server(service: Service, port: int, grace_s: float = 5.0, log_level: str = "warning") -> "object":
    import uvicorn
    from contextlib import asynccontextmanager

    from hetero.serve.http import create_app

    app = create_app(service)

    @asynccontextmanager
    async def lifespan(_app: object):
        yield
        service.close()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=HOST, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s,
                            access_log=False)
    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()  # shut down gracefully: do not die of the signal

    return Server(config)


def serve(service: Service, port: int, grace_s: float = 5.0, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM, then return normally (exit status 0).

    uvicorn re-raises the signal after its graceful shutdown (so the process dies of it, status 128+n);
    here the graceful shutdown is the end of the story, so the captured signals are forgotten.
    """
    bound_malloc()
    server = make_server(service, port, grace_s, log_level)
    server.run()


class BackgroundServer:
    """The HTTP service in a thread of this process (tests, benchmarks); `stop()` shuts it down cleanly."""

    def __init__(self, service: Service, port: int, grace_s: float = 2.0, timeout_s: float = 60.0):
        import threading
        import time

        self.service, self.port, self.url = service, port, f"http://{HOST}:{port}"
        self.server = make_server(service, port, grace_s)
        self.thread = threading.Thread(target=self.server.run, name="hetero-serve-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]
