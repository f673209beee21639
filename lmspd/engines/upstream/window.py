"""An upstream model's context window, learnt from its provider at start.

The window lmspd reports (``context_window`` on ``/v1/models``, what
``lmspd launch`` hands a client to compact by) is, in order:

1. the one the operator gives (``--upstream-context-window``, a config
   entry's ``context_window``);
2. what the provider says, asked once at start (``GET <base>/models``):
   vLLM's and SGLang's model entries carry ``max_model_len``; llama.cpp's
   server marks its entry with ``meta`` and says its per-slot window in
   ``GET /props`` (``default_generation_settings.n_ctx``, at the server's
   root), else only the trained length (``meta.n_ctx_train``). With several
   endpoints, the smallest any of them reports (a request may go to any);
3. ``DEFAULT_CONTEXT_WINDOW`` (a provider that says nothing: OpenAI, Ollama,
   llama-cpp-python's server, or one not up yet).

The start-up log says which (``Window.source``). The requests are
plain and bounded: the endpoints are asked side by side, all within one
deadline (``_TIMEOUT_S``: a body that trickles in is cut off, not waited
for), no redirect followed (the key goes in the header), no proxy from the
environment, bodies up to 1 MiB. Whatever an endpoint answers (a refusal,
another protocol on the port, a body cut short) only means it did not say:
start-up goes on, as it does for a provider that is not up yet.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .credentials import Secret
from .pool import join_url, normalize_base_url, redact_url

__all__ = ["DEFAULT_CONTEXT_WINDOW", "Window", "discover_window"]


# What a provider that says nothing is taken to have.
DEFAULT_CONTEXT_WINDOW = 131072
_MAX_BODY = 1 << 20
_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Window:
    tokens: int
    # Where it came from, for the start-up log: "max_model_len from http://…/v1/models".
    source: str


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # never follow a redirect with the key to somewhere else


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _get_json(url: str, key: Secret | None, deadline: float) -> Any:
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key.reveal()}"
    request = urllib.request.Request(url, headers=headers, method="GET")
    try:
        with _OPENER.open(request, timeout=left) as response:
            if not 200 <= response.status < 300:
                return None
            body = bytearray()
            while len(body) <= _MAX_BODY and time.monotonic() < deadline:
                piece = response.read1(64 * 1024)
                if not piece:
                    return json.loads(body)
                body += piece
            return None  # too long, or still coming at the deadline
    except Exception:  # noqa: BLE001 - http.client's BadStatusLine is no OSError: any answer that is not one is "did not say"
        return None


def _positive(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _entry(listing: Any, model: str) -> dict[str, Any] | None:
    """The ``/models`` entry for ``model`` (or the only one there is)."""
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return None
    entries = [e for e in listing["data"] if isinstance(e, dict)]
    named = [e for e in entries if e.get("id") == model]
    if named:
        return named[0]
    return entries[0] if len(entries) == 1 else None


def _server_root(base_url: str) -> str:
    # The base's query stays: whatever it says (an API version, a
    # deployment) is the server's, and join_url puts it back after /props.
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _endpoint_window(base_url: str, model: str, key: Secret | None, deadline: float) -> Window | None:
    models_url = join_url(base_url, "/models")
    listed = redact_url(models_url)
    entry = _entry(_get_json(models_url, key, deadline), model)
    if entry is None:
        return None
    if (tokens := _positive(entry.get("max_model_len"))) is not None:
        return Window(tokens, f"max_model_len from {listed}")
    meta = entry.get("meta")
    if not isinstance(meta, dict) and entry.get("owned_by") != "llamacpp":
        return None
    # llama.cpp's server: the window each slot has, else the trained length.
    props_url = join_url(_server_root(base_url), "/props")
    props = _get_json(props_url, key, deadline)
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    if isinstance(settings, dict) and (tokens := _positive(settings.get("n_ctx"))) is not None:
        return Window(tokens, f"n_ctx from {redact_url(props_url)}")
    if isinstance(meta, dict) and (tokens := _positive(meta.get("n_ctx_train"))) is not None:
        return Window(tokens, f"meta.n_ctx_train (the trained length) from {listed}")
    return None


def discover_window(urls: Sequence[str], model: str, key: Secret | None = None,
                    timeout_s: float = _TIMEOUT_S) -> Window | None:
    """The smallest window the endpoints at ``urls`` report for ``model``,
    or None where none says, within ``timeout_s`` for all of them (a socket
    that stalls may hold one probe a socket timeout past it)."""
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(max_workers=min(8, len(urls) or 1), thread_name_prefix="lmspd-window") as pool:
        answers = pool.map(lambda url: _endpoint_window(normalize_base_url(url), model, key, deadline), urls)
        found = [w for w in answers if w is not None]
    return min(found, key=lambda w: w.tokens, default=None)
