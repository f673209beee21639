"""The fast tier's fixtures: the whole ASGI app in this process, its
lifespan running, over the scripted engine (tests/support/engine.py) and a
real SQLite store. Nothing here loads a model."""

from __future__ import annotations

import pytest

from support.engine import ScriptedEngine
from support.inprocess import InProcess, serving


@pytest.fixture
def engine() -> ScriptedEngine:
    # Enough events to drop a reader after three and resume it; fast.
    return ScriptedEngine(tuple(f" w{i}" for i in range(8)), delay_s=0.002, max_concurrency=2)


@pytest.fixture
def app(tmp_path, engine) -> InProcess:
    with serving(tmp_path, engine=engine) as served:
        yield served


@pytest.fixture
def http(app):
    return app.http
