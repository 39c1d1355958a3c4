"""Run the HTTP service with uvicorn (127.0.0.1 unless told otherwise); SIGINT/SIGTERM stop it cleanly.

On a signal the engine stops first: queued requests are refused and every running one ends with a
`ShuttingDown` error, so a stream gets an error event and its end instead of being cut (and uvicorn
cancels no response task, which would log tracebacks). uvicorn then stops accepting connections and lets
the responses finish (up to `grace_s`); the app's shutdown closes the service: contexts are saved (with a
state folder) and the swap directory is removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging

from hetero.serve.service import Service

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


def exposure_warning(host: str, api_keys: tuple[str, ...]) -> str | None:
    """What binding beyond loopback risks, or None on loopback."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    risk = (f"hetero serve listens on {host}: every machine that can reach this address can run the model, "
            f"read and change every context and fill the K/V budget")
    return risk + (" (an API key is set: keep it secret, and the traffic is not encrypted: put TLS in front)"
                   if api_keys else "; no --api-key is set, so nothing stops them")


MMAP_THRESHOLD = 16 << 20  # request K/V caches (~46 KB a token for SmolLM2) are above it, prefill temporaries below


def bound_malloc(threshold: int = MMAP_THRESHOLD) -> None:
    """Fix glibc's mmap threshold at `threshold`: K/V buffers of finished requests go back to the OS at once.

    By default glibc raises the threshold after freeing large blocks, and later request buffers then
    come from the heap, which is rarely trimmed: RSS creeps up under a steady load. At 1 MiB (this
    function's threshold before) every prefill temporary of a MiB or more was a fresh mmap, page-faulted on first touch:
    in a real `hetero serve` process a cold 1,024-token prompt's TTFT was 1.32x `hetero run`'s prefill (4 paired
    repeats; 0.99x at 16 MiB), and alternating 1,024-token prefills in one process took a median 2,381 ms at 1 MiB vs
    2,154 ms at 16 MiB (4 each, a shared machine).
    """
    name = ctypes.util.find_library("c")
    if not name:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(name)
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, threshold)


def make_server(service: Service, port: int, grace_s: float = 5.0, log_level: str = "warning",
                host: str = HOST, api_keys: tuple[str, ...] = (), allow_hosts: tuple[str, ...] = ()) -> "object":
    import uvicorn
    from contextlib import asynccontextmanager

    from hetero.serve.http import create_app

    app = create_app(service, host=host, api_keys=api_keys, allow_hosts=allow_hosts)

    @asynccontextmanager
    async def lifespan(_app: object):
        yield
        service.close()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s,
                            access_log=False)

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()  # shut down gracefully: do not die of the signal

        async def shutdown(self, sockets: list | None = None) -> None:
            service.engine.stop()  # running streams end with an error event now, not cut at the grace's end
            await super().shutdown(sockets)

    return Server(config)


def serve(service: Service, port: int, grace_s: float = 5.0, log_level: str = "warning", host: str = HOST,
          api_keys: tuple[str, ...] = (), allow_hosts: tuple[str, ...] = ()) -> None:
    """Serve until SIGINT/SIGTERM, then return normally (exit status 0).

    uvicorn re-raises the signal after its graceful shutdown (so the process dies of it, status 128+n);
    here the graceful shutdown is the end of the story, so the captured signals are forgotten.
    """
    bound_malloc()
    server = make_server(service, port, grace_s, log_level, host, api_keys, allow_hosts)
    server.run()


class BackgroundServer:
    """The HTTP service in a thread of this process (tests, benchmarks); `stop()` shuts it down cleanly."""

    def __init__(self, service: Service, port: int, grace_s: float = 2.0, timeout_s: float = 60.0,
                 api_keys: tuple[str, ...] = ()):
        import threading
        import time

        self.service, self.port, self.url = service, port, f"http://{HOST}:{port}"
        self.server = make_server(service, port, grace_s, api_keys=api_keys)
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
