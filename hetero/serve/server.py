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
    return uvicorn.Server(config)


def serve(service: Service, port: int, grace_s: float = 5.0, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM."""
    bound_malloc()
    server = make_server(service, port, grace_s, log_level)
    server.run()
