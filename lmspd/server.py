"""Process lifecycle: bind, build the service (models load now, or on first
use when several are served), announce the URL, shut down cleanly."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from lmspd import signals
from lmspd.app import build_app
from lmspd.config import Settings
from lmspd.http11 import uvicorn_options
from lmspd.service import Service
from lmspd.store.base import Store
from lmspd.streaming.coalesce import CoalescingMiddleware

log = logging.getLogger("lmspd")

# The signals that stop lmspd: while it serves, a clean shutdown and exit 0;
# while it loads, an exit at once with 128 + the signal's number (130 for
# Ctrl-C, 143 for SIGTERM), as a shell reports a process the signal ended.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn, plus: print the URL once bound, and on SIGINT/SIGTERM end
    in-flight generations with a terminal event before connections drain."""

    def __init__(self, config: uvicorn.Config, service: Service, settings: Settings) -> None:
        super().__init__(config)
        self._service = service
        self._settings = settings

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        port = self._settings.port
        for server in self.servers:
            for sock in server.sockets:
                port = sock.getsockname()[1]
                break
        self._settings.port = port
        print(f"lmspd serving {', '.join(self._service.models)} at {self._settings.url}", flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._service.shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less its last step: after a clean shutdown it raised the
        signal that asked for it again, so Ctrl-C ended in a KeyboardInterrupt
        traceback (status 1 or -2) and SIGTERM in -15. Stopped as asked, lmspd
        exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may set handlers (a server run in a test's thread)
            return
        # A signal the process was started ignoring stays ignored, as while it
        # loads (``signals.raised``): a background job's SIGINT, nohup's.
        previous: dict[int, Any] = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS
                                    if signal.getsignal(sig) is not signal.SIG_IGN}
        try:
            yield
        finally:
            signals.restore(previous)


def serve(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        # Bound before the model loads: a port in use or a host that does not
        # resolve is said at once, not after the load (minutes for a large model).
        sockets = bind(settings.host, settings.port)
    except OSError as exc:
        _cannot_listen(settings, exc)
        return 2
    try:
        return _serve_on(sockets, settings)
    finally:
        for sock in sockets:
            sock.close()


def _serve_on(sockets: list[socket.socket], settings: Settings) -> int:
    if not settings.api_keys and not settings.loopback:
        # Only an address that resolves to loopback alone may run open: ""
        # and 0.0.0.0 bind every interface.
        print(
            f"lmspd: refusing to listen on {settings.host!r} without an API key; "
            "pass --api-key (or bind to 127.0.0.1)",
            file=sys.stderr,
        )
        return 2
    try:
        store, service = _load(settings)
    except Exception as exc:  # a bad --model or data dir is the user's to fix: say so plainly
        print(f"lmspd: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        # One socket write per burst of stream events, not per event.
        CoalescingMiddleware(build_app(settings, service, store)),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(settings.limits.shutdown_grace_s),
        lifespan="on",
        # Request heads bounded by limits.max_header_bytes, refused as a 431.
        **uvicorn_options(settings.limits.request),
    )
    try:
        # Listening only now: a client that connects during the load is
        # refused at once rather than left waiting in the backlog. (Another
        # server that bound the same port meanwhile is found here.)
        for sock in sockets:
            sock.listen(config.backlog)
    except OSError as exc:
        _cannot_listen(settings, exc)
        return 2
    server = _Server(config, service, settings)
    server.run(sockets=sockets)
    return 0


def _cannot_listen(settings: Settings, exc: OSError) -> None:
    # strerror: "Address already in use", "Name or service not known".
    print(f"lmspd: cannot listen on {settings.host or '*'} port {settings.port}: {exc.strerror or exc}",
          file=sys.stderr)


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening) to every address ``host`` resolves
    to ("": every interface), as asyncio's ``create_server`` binds them for
    uvicorn: address reuse (a restart finds the port in TIME_WAIT), IPv6
    sockets IPv6 only, an address family the machine lacks skipped."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    skipped: OSError | None = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # a family this kernel does not speak
                skipped = exc
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:  # in use, not permitted: the caller's to say
                    raise
                skipped = exc  # ::1 where IPv6 is off
                sockets.pop().close()
        if not sockets:
            raise skipped or OSError(errno.EADDRNOTAVAIL, "no address to bind")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class _Stopped(signals.Signalled):
    """SIGINT or SIGTERM while the service loads."""


def _load(settings: Settings) -> tuple[Store, Service]:
    """``open_store`` and ``build_service`` in a thread of their own, the main
    thread waiting: a load in the main thread sits in llama.cpp, where the
    only Python that runs is its log callback, and ctypes swallows the
    KeyboardInterrupt raised there (Ctrl-C was ignored and the server went
    on to serve). SIGINT and SIGTERM meanwhile end the process at once,
    without a traceback: there is nothing to shut down yet, and the load
    cannot be stopped inside llama.cpp."""
    done = threading.Event()
    outcome: list[Any] = []

    def load() -> None:
        try:
            outcome.append((open_store(settings), build_service(settings)))
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            outcome.append(exc)
        finally:
            done.set()

    try:
        with signals.raised(_Stopped, STOP_SIGNALS):
            threading.Thread(target=load, name="lmspd-load", daemon=True).start()
            done.wait()
    except _Stopped as stopped:
        print(f"lmspd: interrupted ({stopped.name}) while loading: exiting without serving", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Not sys.exit: the interpreter's shutdown would wait for the load,
        # or free what the loading thread is still inside.
        os._exit(128 + stopped.signal)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    store, service = outcome[0]
    return store, service


def open_store(settings: Settings) -> Store:
    # --store postgresql://... shares state between instances; the default
    # is the embedded SQLite file in the data dir.
    from lmspd import store

    target = settings.store or settings.data_dir / "lmspd.sqlite3"
    return store.open_store(target, retention=settings.retention, lease_s=settings.store_lease_s)


def build_service(settings: Settings) -> Service:
    # The models and their engines: --config FILE, or the one the flags name.
    from lmspd.engines.registry import ModelRegistry, lazy_llama_engine
    from lmspd.engines.specs import (
        ConfigError,
        LlamaSpec,
        build_engine,
        check_served_id,
        spec_sources,
        specs_from_settings,
    )

    service = Service(settings.limits)
    specs = specs_from_settings(settings)
    # Where each model was given (a flag, a config entry): two under one id are refused.
    sources = spec_sources(settings, specs)
    given: dict[str, tuple[str, str]] = {}
    # Local models by their id's case-folded form: each has a KV checkpoint folder named by its id.
    local: dict[str, tuple[str, str]] = {}
    # Several local models, or a memory or idle limit: each loads on first use.
    lazy = (sum(isinstance(s, LlamaSpec) for s in specs) > 1 or settings.models_max_mem_mb is not None
            or settings.models_idle_s is not None)
    registry = ModelRegistry(None if settings.models_max_mem_mb is None else settings.models_max_mem_mb << 20,
                             settings.models_idle_s) if lazy else None
    for spec, source in zip(specs, sources, strict=True):
        if registry is not None and isinstance(spec, LlamaSpec):
            engine = lazy_llama_engine(spec, settings, registry)
        else:
            engine = build_engine(spec, settings)
        served = check_served_id(engine.info.id, f"{source}: its id (give another with --served-model or --config)")
        if served in given:
            first, first_file = given[served]
            same = " (the same model twice)" if first_file == engine.info.source else ""
            raise ConfigError(f"two models would be served as {served!r}: {first} and {source}{same}; give each "
                              "its own id (--served-model renames the first --model; a --config file names every "
                              "model) or drop one")
        given[served] = (source, engine.info.source)
        if isinstance(spec, LlamaSpec):
            other, other_source = local.setdefault(served.casefold(), (served, source))
            if other != served:
                raise ConfigError(f"two local models are served as {other!r} ({other_source}) and {served!r} "
                                  f"({source}), ids that differ only in letter case: on a case-insensitive file "
                                  "system (macOS's and Windows' default) their KV checkpoint folders are one, which "
                                  "each would prune as its own (and remove the other model's checkpoints); give one of them another id")
        log.info("serving %s from %s", engine.info.id, engine.info.source)
        service.add_engine(engine)
    if registry is not None:
        registry.bind(service)
    return service
