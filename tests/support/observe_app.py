"""An in-process app over a scripted engine and a real store, for unit
tests of routes that read engine state (metrics, the engine view)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from lmspd.app import build_app
from lmspd.config import Settings
from lmspd.core.events import Usage
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.service import Service
from lmspd.store.sqlite import SQLiteStore
from support import engine


class ScriptedEngine(engine.ScriptedEngine):
    """Reports fixed usage and a fixed cache source, as the llama engine does
    (on the generation's usage; its stats() name the last one too)."""

    def __init__(self, usage: Usage, source: str) -> None:
        super().__init__(("hello", " there"), model="m", context_window=1000,
                         capabilities={"streaming": True}, usage=usage, cache_source=source,
                         stats={"cache": {"ram_bytes": 1234, "ram_sessions": 2, "disk_bytes": 5678}})


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def make_client(tmp_path, engine, api_keys=()) -> TestClient:
    settings = Settings(data_dir=tmp_path, api_keys=list(api_keys))
    service = Service(DEFAULT_LIMITS)
    service.add_engine(engine)
    store = SQLiteStore(tmp_path / "s.sqlite3", retention=settings.retention)
    return TestClient(build_app(settings, service, store), base_url="http://localhost")
