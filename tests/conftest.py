from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.server import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def server():
    """One real lmspd process with the bundled model, shared by every test
    that does not need its own configuration."""
    srv = ServerProcess("--ctx", "4096").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused-locally", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def small_server():
    """A second process with a tiny context window, one sequence and a
    one-deep queue, for tests about limits and queueing (cheap to fill,
    cheap to prefill)."""
    srv = ServerProcess("--ctx", "512", "--parallel", "1", "--max-queue", "1").start()
    yield srv
    srv.stop()
