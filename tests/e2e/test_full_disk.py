"""A full disk, black-box: the real server process's file-size limit is
lowered to 0 while it serves, so that no write of SQLite's (nor any other
file write) can land, as on a disk with no room left. A response that could
not be stored must never be answered as stored (README: Stored state and
tasks): a JSON reply is a 503 ``store_unavailable`` in the dialect's shape,
before any output; a stream, whose output the client already has, ends with
its terminal event saying ``store: false``; nothing is answered with an id
that a GET cannot find once the disk works again.

CPython ignores SIGXFSZ at start, so a write past the limit fails with
EFBIG (SQLite: "disk I/O error") instead of killing the process; the test
checks that the server lived through it and that the writes really failed.
"""

from __future__ import annotations

import json
import resource
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from support.server import MODEL, ServerProcess
from support.sse import parse_frames

pytestmark = pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit(2) (Linux)")

LMSP = {"LMSP-Version": "1.0"}
# A whole answer (8 tokens may end it as incomplete): the output reached the client.
ENDED = ("response.completed", "response.incomplete")


def body(**extra) -> dict:
    return {"model": MODEL, "input": "Say hello.", "temperature": 0, "max_output_tokens": 8, **extra}


@contextmanager
def full_disk(pid: int) -> Iterator[None]:
    """No file of process ``pid`` can grow while inside (RLIMIT_FSIZE 0)."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


def last_event(reply: httpx.Response) -> tuple[str | None, dict]:
    frames = [f for f in parse_frames(reply.iter_lines()) if f.data != "[DONE]"]
    return frames[-1].event, frames[-1].json()


def test_a_full_disk_never_answers_an_unstored_response_as_stored() -> None:
    srv = ServerProcess("--ctx", "1024", "--parallel", "1").start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            # The model is loaded and the store has written before the disk fills.
            before = http.post("/v1/responses", json=body())
            assert before.status_code == 200, before.text
            key = {"Idempotency-Key": f"full-{uuid.uuid4()}"}

            with full_disk(srv.proc.pid):
                r = http.post("/v1/responses", json=body())
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "store_unavailable" and "Retry-After" in r.headers

                r = http.post("/lmsp/v1/responses", json=body(store=True), headers=LMSP)
                assert r.status_code == 503, r.text
                assert r.headers["content-type"].startswith("application/problem+json")
                assert r.json()["code"] == "store_unavailable"

                with http.stream("POST", "/v1/responses", json=body(stream=True)) as reply:
                    assert reply.status_code == 200
                    name, data = last_event(reply)
                assert name in ENDED and data["response"]["store"] is False, data
                streamed_id = data["response"]["id"]

                with http.stream("POST", "/lmsp/v1/responses", json=body(stream=True, store=True),
                                 headers=LMSP) as reply:
                    name, data = last_event(reply)
                assert name in ENDED and data["store"] is False, data

                # A background response is a task that cannot be stored: never started.
                r = http.post("/v1/responses", json=body(background=True))
                assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text

                # A key that cannot be recorded cannot guard the request: not run.
                r = http.post("/v1/responses", json=body(), headers=key)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "store_unavailable" and "Retry-After" in r.headers

            assert srv.proc.poll() is None, "the server died of the full disk"
            assert any(error in srv.log() for error in ("disk I/O error", "database or disk is full")), \
                "the writes did not fail: the test proved nothing"

            # The disk has room again: what said it was not stored is not there,
            # and the store works as before.
            assert http.get(f"/v1/responses/{streamed_id}").status_code == 404
            assert http.get(f"/v1/responses/{before.json()['id']}").status_code == 200
            r = http.post("/v1/responses", json=body(), headers=key)
            assert r.status_code == 200 and r.json()["store"] is True, r.text
            assert http.get(f"/v1/responses/{r.json()['id']}").status_code == 200
            replay = http.post("/v1/responses", json=body(), headers=key)
            assert replay.headers.get("Idempotent-Replayed") == "true"
            assert json.loads(replay.content)["id"] == r.json()["id"]
    finally:
        srv.stop()
