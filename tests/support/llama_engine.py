"""The bundled model's llama engine in this process, for unit tests of the
engine's parts that need a real model but no server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lmspd.engines.llama.engine import LlamaEngine
from lmspd.engines.llama.models import resolve_model
from support.server import MODEL


@contextmanager
def bundled_engine(*, n_ctx: int = 512, **options: Any) -> Iterator[LlamaEngine]:
    """One thread, so that a test's timing does not depend on the machine's
    core count; closed (its scheduler thread stopped) afterwards."""
    model_id, path = resolve_model(MODEL)
    engine = LlamaEngine(model_id, path, n_ctx=n_ctx, n_threads=1, **options)
    try:
        yield engine
    finally:
        asyncio.run(engine.aclose())
