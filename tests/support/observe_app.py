"""An in-process app over a scripted engine and a real store, for unit
tests of routes that read engine state (metrics, the engine view)."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from lmspd.app import build_app
from lmspd.config import Settings
from lmspd.core.events import Finished, TextDelta, Usage
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.engines.base import ModelInfo
from lmspd.service import Service
from lmspd.store.sqlite import SQLiteStore


class ScriptedEngine:
    """Reports fixed usage and a fixed cache source, as the llama engine does
    (on the generation's usage; its stats() name the last one too)."""

    def __init__(self, usage: Usage, source: str) -> None:
        self.info = ModelInfo(id="m", context_window=1000, capabilities={"streaming": True})
        self.usage = usage
        self.source = source

    opens_first = False  # the Engine protocol: nothing to reach before generating

    async def open(self, prepared, cancel) -> None:
        return None

    def prepare(self, conversation):
        class P:
            input_tokens = 1
            response_id = None

        return P()

    async def generate(self, prepared, cancel, response_id=None):
        yield TextDelta("hello")
        yield TextDelta(" there")
        yield Finished("stop", dataclasses.replace(self.usage, cache_source=self.source))

    def count_tokens(self, conversation) -> int:
        return 1

    def stats(self) -> dict:
        return {"last_cache_source": self.source,
                "cache": {"ram_bytes": 1234, "ram_sessions": 2, "disk_bytes": 5678}}

    async def aclose(self) -> None:
        pass


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
    return TestClient(build_app(settings, service, store))
