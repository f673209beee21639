"""A browser is not a client: requests a web page makes on its own are refused.

lmspd's clients (SDKs, Codex, Claude Code, curl) send no ``Origin``; a web
page's requests always carry one, and a page can reach the server two ways
the same-origin policy does not stop:

- a WebSocket: browsers let any site open ``ws://127.0.0.1:8080/v1/responses``
  (CORS does not apply to sockets), and in the default open mode every
  caller is the one local owner;
- DNS rebinding: a site's name that resolves to 127.0.0.1 makes the page
  same-origin with the server, so it can read every GET.

So a request whose ``Origin`` is neither the server's own (the origin of
its ``Host``) nor a loopback one, nor one ``--allowed-origins`` names, is a
403; and when the server is bound to loopback, a request whose ``Host`` is
not a loopback name or address (``localhost``, ``*.localhost``,
``127.0.0.0/8``, ``::1``), the bound address, or the host of an allowed
origin is a 421, before any route runs. Both in the shape of the dialect
the path belongs to (``lmspd.edge.error_reply``); a refused WebSocket
upgrade gets the same HTTP reply, or a close before accepting.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from lmspd.core.errors import ApiError
from lmspd.edge import error_reply


def split_origins(values: Iterable[str]) -> list[str]:
    """``--allowed-origins`` values (each may list several, comma-separated)
    as normalized origins (``scheme://host[:port]``, lowercase), or ``*``.
    A value that is no origin is a ``ValueError`` naming it."""
    out: list[str] = []
    for value in values:
        for entry in value.split(","):
            entry = entry.strip()
            if not entry:
                continue
            if entry == "*":
                out.append(entry)
                continue
            parts = urlsplit(entry)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                    or parts.query or parts.fragment or parts.username is not None:
                raise ValueError(f"{entry!r} is not an origin (scheme://host[:port], e.g. https://app.example)")
            out.append(_origin(parts.scheme, parts.netloc))
    return out


def _origin(scheme: str, netloc: str) -> str:
    return f"{scheme.lower()}://{netloc.lower()}"


def host_name(host: str) -> str:
    """The name part of a ``Host`` value: ``[::1]:8080`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host  # a bare name, or a bare IPv6 address (not valid HTTP, but unambiguous)


def is_loopback_name(name: str) -> bool:
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class BrowserGuard:
    """ASGI middleware for HTTP and WebSocket scopes (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, allowed_origins: Iterable[str], bound_host: str, check_host: bool) -> None:
        self.app = app
        origins = list(allowed_origins)
        self._any_origin = "*" in origins
        self._origins = frozenset(o for o in origins if o != "*")
        self._check_host = check_host
        self._hosts = frozenset({host_name(bound_host)} | {host_name(urlsplit(o).netloc) for o in self._origins})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = origin = None
        for name, value in scope.get("headers", []):
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
        refusal = None
        if self._check_host and host is not None and not self._host_allowed(host):
            refusal = ApiError("misdirected_request", f"Host {host[:256]!r} is not this server's: bound to "
                               "loopback, lmspd answers only requests for a loopback name or address (a web "
                               "page that renamed 127.0.0.1 is refused). Use http://127.0.0.1 or "
                               "http://localhost, or name the host in --allowed-origins.")
        elif origin is not None and not self._origin_allowed(origin, host, scope):
            refusal = ApiError("forbidden", f"Origin {origin[:256]!r} may not use this server: a web page is "
                               "not a client. Start lmspd with --allowed-origins (or LMSPD_ORIGINS) naming it "
                               "to allow it.")
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await error_reply(scope.get("path", ""), refusal)(scope, receive, send)
        else:
            ws = WebSocket(scope, receive, send)
            if "websocket.http.response" in scope.get("extensions", {}):
                await ws.send_denial_response(error_reply(scope.get("path", ""), refusal))
            else:
                await ws.close(code=1008)

    def _host_allowed(self, host: str) -> bool:
        name = host_name(host)
        return is_loopback_name(name) or name in self._hosts

    def _origin_allowed(self, origin: str, host: str | None, scope: Scope) -> bool:
        if self._any_origin:
            return True
        try:
            parts = urlsplit(origin.strip())
            hostname = parts.hostname
        except ValueError:  # "http://[": urlsplit refuses it (a 500 and a traceback, per request)
            return False
        if parts.scheme not in ("http", "https") or not hostname:
            return False  # "null" (a file:// page, a sandboxed frame), or not an origin at all
        if is_loopback_name(hostname):
            return True
        if _origin(parts.scheme, parts.netloc) in self._origins:
            return True
        # The server's own origin: the page the console is served on.
        return host is not None and parts.netloc.lower() == host.strip().lower()
