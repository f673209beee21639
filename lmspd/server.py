"""Process lifecycle: build the service (models load now, or on first use
when several are served), bind, announce the URL, shut down cleanly."""

from __future__ import annotations

import logging
import sys
from typing import Any

import uvicorn

from lmspd.app import build_app
from lmspd.config import Settings
from lmspd.http11 import uvicorn_options
from lmspd.service import Service
from lmspd.store.base import Store
from lmspd.streaming.coalesce import CoalescingMiddleware

log = logging.getLogger("lmspd")


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


def serve(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
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
        store = open_store(settings)
        service = build_service(settings)
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
    server = _Server(config, service, settings)
    server.run()
    return 0


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
        log.info("serving %s from %s", engine.info.id, engine.info.source)
        service.add_engine(engine)
    if registry is not None:
        registry.bind(service)
    return service
