"""Idempotency-Key (lmspd.idempotency) over a real SQLite store: at most
once per key and credential, a replay of the kept reply, 409 while the
first runs, 422 for another request, and a key released by any failure —
an error reply, an exception, or a stream the client left half-way. (The
same through the whole app: tests/unit/routes/test_route_idempotency.py.)"""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from lmspd import idempotency
from lmspd.core.errors import ApiError
from lmspd.core.limits import MAX_IDEMPOTENCY_KEY_CHARS
from lmspd.idempotency import REPLAYED, Reply, once
from lmspd.store.calls import StoreCalls
from lmspd.store.sqlite import SQLiteStore

# The store's own threads, as the app has them (shared by every test here).
CALLS = StoreCalls()


@pytest.fixture
def store(tmp_path):
    s = SQLiteStore(tmp_path / "s.sqlite3")
    yield s
    s.close()


def request(key: str | None = "k1", path: str = "/v1/responses") -> Request:
    headers = [(b"idempotency-key", key.encode())] if key is not None else []
    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""})


class Work:
    def __init__(self, status: int = 200) -> None:
        self.runs = 0
        self.status = status

    async def __call__(self) -> Reply:
        self.runs += 1
        return Reply(JSONResponse({"run": self.runs}, status_code=self.status))


def call(store, work, key="k1", body=None, owner="alice", path="/v1/responses"):
    return asyncio.run(once(store, CALLS, owner, request(key, path), body or {"input": "hi"}, work))


def test_without_a_key_every_call_runs(store) -> None:
    work = Work()
    call(store, work, key=None)
    call(store, work, key=None)
    assert work.runs == 2


def test_a_retry_replays_the_first_reply(store) -> None:
    work = Work()
    first = call(store, work)
    again = call(store, work)
    assert work.runs == 1 and again.body == first.body and again.status_code == 200
    assert again.headers[REPLAYED] == "true" and REPLAYED not in first.headers
    assert again.headers["content-type"] == first.headers["content-type"]


def test_another_body_path_or_owner(store) -> None:
    work = Work()
    call(store, work)
    with pytest.raises(ApiError) as info:
        call(store, work, body={"input": "other"})
    assert info.value.code == "idempotency_conflict" and info.value.status == 422
    with pytest.raises(ApiError):
        call(store, work, path="/lmsp/v1/responses")
    call(store, work, owner="bob")  # another credential: its own key space
    assert work.runs == 2


def test_key_order_in_the_body_is_the_same_request(store) -> None:
    work = Work()
    call(store, work, body={"a": 1, "b": 2})
    assert REPLAYED in call(store, work, body={"b": 2, "a": 1}).headers and work.runs == 1


def test_an_error_reply_or_an_exception_releases_the_key(store) -> None:
    failing = Work(status=404)
    call(store, failing)
    call(store, failing)
    assert failing.runs == 2

    async def boom() -> Reply:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        asyncio.run(once(store, CALLS, "alice", request("k2"), {}, boom))
    ok = Work()
    call(store, ok, key="k2", body={})
    assert ok.runs == 1


def test_a_running_attempt_is_409_with_retry_after(store) -> None:
    async def go() -> None:
        gate = asyncio.Event()

        async def slow() -> Reply:
            await gate.wait()
            return Reply(JSONResponse({}))

        first = asyncio.ensure_future(once(store, CALLS, "alice", request(), {}, slow))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as info:
            await once(store, CALLS, "alice", request(), {}, slow)
        assert info.value.code == "idempotency_in_progress"
        assert int(info.value.headers["Retry-After"]) == idempotency.RETRY_AFTER_S
        gate.set()
        await first

    asyncio.run(go())


def stream_reply(chunks):
    async def body():
        for c in chunks:
            yield c

    async def work() -> Reply:
        return Reply(StreamingResponse(body(), media_type="text/event-stream"))

    return work


def test_a_stream_is_kept_once_sent_whole_and_released_if_left(store) -> None:
    async def go() -> None:
        whole = await once(store, CALLS, "alice", request("s1"), {}, stream_reply([b"a", b"b"]))
        assert [c async for c in whole.body_iterator] == [b"a", b"b"]
        again = await once(store, CALLS, "alice", request("s1"), {}, stream_reply([b"x"]))
        assert again.body == b"ab" and again.headers[REPLAYED] == "true"

        left = await once(store, CALLS, "alice", request("s2"), {}, stream_reply([b"a", b"b"]))
        it = left.body_iterator
        assert await it.__anext__() == b"a"
        await it.aclose()  # the client went away half-way
        rerun = await once(store, CALLS, "alice", request("s2"), {}, stream_reply([b"c"]))
        assert REPLAYED not in rerun.headers

    asyncio.run(go())


@pytest.mark.parametrize("bad", ["", "x" * (MAX_IDEMPOTENCY_KEY_CHARS + 1), "tab\tkey", "k\u00e9y"])
def test_a_malformed_key_is_400_naming_the_header(store, bad) -> None:
    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"idempotency-key", bad.encode("latin-1"))]}
    with pytest.raises(ApiError) as info:
        asyncio.run(idempotency.begin(store, CALLS, "alice", Request(scope), {}))
    assert info.value.status == 400 and info.value.param == "Idempotency-Key"
