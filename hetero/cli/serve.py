"""`hetero serve`: the OpenAI-compatible service (`hetero.serve`), on 127.0.0.1 unless --host says otherwise."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from hetero.cli import add_command
from hetero.arguments import add_method_arg, add_model_arg, positive_int
from hetero.errors import ConfigError

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(text: str, name: str = "--kv-budget") -> int | None:
    """'512M', '2G', '65536' → bytes; 'none' → unbounded."""
    if text.strip().lower() in ("none", "unbounded"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)i?b?\s*", text.lower())
    if not m:
        raise ConfigError(f"{name} must be a size like 512M, 2G or 65536 (bytes), or 'none', got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def register(sub: Any) -> None:
    p = add_command(sub, "serve")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; another one prints a warning)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="another name clients may use in the Host header (e.g. a reverse proxy's; repeatable)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (repeatable: each key owns its contexts); "
                        "default: $HETERO_API_KEY if set, else no key")
    p.add_argument("--state-dir", default=None,
                   help="where contexts are saved on shutdown and restored at start (default: in the cache, per "
                        "model and method; 'none': not saved)")
    add_model_arg(p)
    add_method_arg(p)
    p.add_argument("--chunk", type=positive_int, default=256, help="prefill chunk length C (default 256)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-budget", default="512M", help="RAM for kept K/V across contexts, e.g. 256M, 2G, none (default 512M)")
    p.add_argument("--kv-block", type=positive_int, default=16, help="tokens per K/V block (default 16, LLMS)")
    p.add_argument("--kv-compress", choices=("auto", "off"), default="auto",
                   help="compress blocks (INT8/INT4 by measured error) before swapping them (default auto)")
    p.add_argument("--kv-tolerance", type=float, default=0.1, help="attention-output error allowed for INT4 (default 0.1)")
    p.add_argument("--kv-reserve", type=float, default=0.1, help="fraction of the budget kept free ahead of time")
    p.add_argument("--no-kv-disk", dest="kv_disk", action="store_false", help="never swap to disk (drop + recompute)")
    p.add_argument("--kv-disk-budget", default="auto",
                   help="disk for swapped K/V, e.g. 2G; beyond it blocks are dropped and recomputed (default auto: "
                        "a quarter of the free space in --kv-dir, at most 16G)")
    p.add_argument("--kv-dir", type=Path, default=None, help="where the private swap directory goes (default: temp)")
    p.add_argument("--reuse", choices=("exact", "any"), default="exact",
                   help="exact: reuse only cached K/V that a cold prefill computes bit for bit, so replies do not "
                        "depend on the cache (default); any: every cached token (fewer tokens prefilled, an INT8 "
                        "method's replies may differ from a cold run's)")
    p.add_argument("--kv-restore", choices=("auto", "swap", "recompute"), default="auto",
                   help="restoring a swapped block: the cheaper per block, pipelined (auto), or always one way")
    p.add_argument("--max-contexts-per-client", type=positive_int, default=8)
    p.add_argument("--max-active", type=positive_int, default=4, help="requests interleaved at once (default 4)")
    p.add_argument("--max-queue", type=positive_int, default=16, help="waiting requests before 429 (default 16)")
    p.set_defaults(func=cmd_serve)


def check_port(host: str, port: int) -> None:
    """ConfigError (one line, exit 2) when the service could not listen on `host`:`port`: another server holds the
    port, or the address is not this machine's. Bound as uvicorn binds (SO_REUSEADDR), then released."""
    import socket

    if port == 0:  # any free port: uvicorn picks one
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); another server may "
                          f"hold it: pick another --port, or --port 0 for any free one") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from hetero.loader import load_model
    from hetero.methods import make_service
    from hetero.serve import persist
    from hetero.serve.disk import default_disk_budget
    from hetero.serve.server import exposure_warning, serve
    from hetero.serve.store import StoreConfig

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    check_port(args.host, args.port)  # before the model loads and the service warms up, not after
    keys = tuple(args.api_key or ([os.environ["HETERO_API_KEY"]] if os.environ.get("HETERO_API_KEY") else []))
    if any(not k.strip() or any(c.isspace() for c in k) for k in keys):
        raise ConfigError("--api-key must be a non-empty key without spaces")
    disk_budget = (default_disk_budget(args.kv_dir) if args.kv_disk_budget.strip().lower() == "auto"
                   else parse_bytes(args.kv_disk_budget, "--kv-disk-budget"))
    store = StoreConfig(block=args.kv_block, budget_bytes=parse_bytes(args.kv_budget), reserve=args.kv_reserve,
                        compress=args.kv_compress, tolerance=args.kv_tolerance, disk=args.kv_disk,
                        disk_budget_bytes=disk_budget, kv_dir=args.kv_dir, restore=args.kv_restore,
                        exact=args.reuse == "exact")
    model = load_model(args.model)
    state_key = {"model": model.fingerprint, "method": args.method}
    state_dir = None if (args.state_dir or "").lower() == "none" else \
        Path(args.state_dir) if args.state_dir else persist.default_folder(model.fingerprint, args.method)
    warning = exposure_warning(args.host, keys)
    if warning:
        print(f"hetero: warning: {warning}", file=sys.stderr, flush=True)
    service = make_service(model, args.method, args.chunk, args.threads, store,
                           max_contexts_per_client=args.max_contexts_per_client, max_active=args.max_active,
                           max_queue=args.max_queue, state_dir=state_dir, state_key=state_key)
    service.warm_up()  # the first request's TTFT is then a prefill's, as `hetero run` times it
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"hetero: serving {service.model_name} ({args.method}, C={args.chunk}) on http://{shown}:{args.port}/v1"
          f"{' (API key required)' if keys else ''}; contexts saved in {state_dir or 'nowhere (--state-dir none)'}",
          flush=True)
    serve(service, args.port, host=args.host, api_keys=keys, allow_hosts=tuple(args.allow_host))
    return 0
