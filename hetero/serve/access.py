"""Who may talk to `hetero serve`: Host allow-list, JSON-only bodies and the API key.

A plain ASGI middleware, in front of every route:
- `Host` must name this server (127.0.0.1, localhost, ::1, the `--host` value, and for a wildcard --host
  this machine's name and addresses, plus any `--allow-host`): a page that rebinds its own DNS name to
  127.0.0.1 reaches the port, but with its own name in `Host`, and gets 421.
- A POST must declare `Content-Type: application/json`: the only bodies a web page may send another origin
  without a CORS preflight (text/plain, forms) are refused with 415, so a page the user opens cannot make
  the browser generate, save or flush (CSRF). The server sends no CORS headers.
- With API keys, every route but the page and /health needs `Authorization: Bearer <key>` (401 otherwise),
  and the key, not the self-asserted `X-Client-Id`, is the owner of the contexts it creates.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
from collections.abc import Awaitable, Callable, Iterable

from hetero.serve import openai_api as oa

PUBLIC = frozenset({"/", "/health", "/favicon.ico"})  # no key: the page asks for it, a probe needs none
LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")
OWNER = "hetero.owner"  # ASGI scope key: the owner a key stands for (absent: no keys configured)


def owner_of_key(key: str) -> str:
    """The client name of a key's contexts: a digest, so listings never show the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def host_name(header: str) -> str:
    """`Host` header → its name without the port ('[::1]:8000' → '::1')."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def allowed_hosts(host: str, extra: Iterable[str] = ()) -> set[str]:
    """The names `Host` may carry: the loopback names, `host`, `extra`, and for a wildcard `host` (0.0.0.0,
    ::) this machine's name, its fully qualified name and their addresses."""
    names = {n.lower() for n in LOCAL_NAMES} | {host_name(host)} | {host_name(e) for e in extra}
    if host in ("0.0.0.0", "::", ""):
        own = {socket.gethostname(), socket.getfqdn()}
        for name in list(own):
            try:
                own |= {info[4][0] for info in socket.getaddrinfo(name, None)}
            except OSError:
                continue
        names |= {n.lower() for n in own if n}
    return names


class AccessMiddleware:
    def __init__(self, app: Callable, host: str = "127.0.0.1", api_keys: Iterable[str] = (),
                 allow_hosts: Iterable[str] = ()):
        self.app = app
        self.allowed = allowed_hosts(host, allow_hosts)
        self.keys = [k.encode() for k in api_keys if k]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = host_name(headers.get("host", ""))
        if host not in self.allowed:
            await _refuse(send, 421, "misdirected_request",
                          f"Host {headers.get('host', '')!r} is not this server's (allowed: {sorted(self.allowed)})",
                          "Host")
            return
        if self.keys and scope["path"] not in PUBLIC:
            got = headers.get("authorization", "")
            token = got[7:].strip().encode() if got[:7].lower() == "bearer " else b""
            match = next((k for k in self.keys if hmac.compare_digest(token, k)), None)
            if match is None:
                await _refuse(send, 401, "invalid_api_key",
                              "missing or wrong API key: send 'Authorization: Bearer <key>'", "Authorization",
                              [(b"www-authenticate", b"Bearer")])
                return
            scope[OWNER] = owner_of_key(match.decode())
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                await _refuse(send, 415, "unsupported_media_type",
                              f"Content-Type must be application/json, got {media or 'none'!r}", "Content-Type")
                return
        await self.app(scope, receive, send)


async def _refuse(send: Callable[[dict], Awaitable[None]], status: int, code: str, message: str, param: str,
                  extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(oa.error_body(message, "invalid_request_error", code=code, param=param)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
