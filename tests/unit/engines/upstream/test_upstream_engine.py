"""The upstream engine in-process, against the scripted provider: refusals
before the stream, cancellation and shutdown, failover, affinity, health."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest

from lmspd.core.conversation import Conversation, CustomTool, FunctionTool, Message
from lmspd.core.errors import ApiError
from lmspd.core.events import Failed, Finished, TextDelta, ToolCallStarted
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.core.run import LOCAL, RunContext
from lmspd.engines.base import CancelToken
from lmspd.engines.upstream.credentials import Secret
from lmspd.engines.upstream.engine import UpstreamEngine, UpstreamSpec
from lmspd.service import Service
from support.provider import (
    Reply,
    ScriptedProvider,
    error_reply_body,
    sse,
    text_chunk,
    text_stream,
    tool_stream,
)


@pytest.fixture(scope="module")
def provider2():
    p = ScriptedProvider().start()
    yield p
    p.stop()


@pytest.fixture(autouse=True)
def _clean(provider, provider2):
    provider.clear()
    provider2.clear()


def engine(*urls: str, key: str | None = None, **spec) -> UpstreamEngine:
    return UpstreamEngine(UpstreamSpec(served_model="up", upstream_model="m", urls=list(urls), **spec),
                          key=Secret(key) if key else None)


def conversation(text: str = "hi", **kw) -> Conversation:
    return Conversation(model="up", items=[Message(role="user", text=text)], **kw)


async def collect(eng: UpstreamEngine, conv: Conversation, cancel: CancelToken | None = None,
                  run: RunContext = LOCAL) -> list:
    prepared = eng.prepare(conv, run)
    return [e async for e in eng.generate(prepared, cancel or CancelToken())]


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def run(coro):
    return asyncio.run(coro)


def test_text_generation(provider):
    provider.push(Reply(parts=text_stream("Hello!")))

    async def go():
        eng = engine(provider.url)
        try:
            return await collect(eng, conversation())
        finally:
            await eng.aclose()

    events = run(go())
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello!"
    assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
    assert events[-1].usage.input_tokens == 11


def test_a_provider_that_sends_no_usage_is_reported_an_estimate(provider):
    """The engine gives the bridge its estimate of the request's size: zeros
    read as real counts (bridge: ``_usage_or_estimate``)."""
    provider.push(Reply(parts=[p for p in text_stream("Hello there, world!") if b'"usage"' not in p]))

    async def go():
        eng = engine(provider.url)
        try:
            conv = conversation("x" * 400)
            return eng.prepare(conv).input_tokens, await collect(eng, conv)
        finally:
            await eng.aclose()

    estimate, events = run(go())
    assert isinstance(events[-1], Finished)
    assert events[-1].usage.input_tokens == estimate > 100 and events[-1].usage.output_tokens > 0


def test_service_open_refuses_before_any_byte_with_status_and_retry_after(provider):
    provider.push(Reply(status=429, content_type="application/json", headers={"Retry-After": "7"},
                        body=error_reply_body("rate_limit_error")))

    async def go():
        service = Service(DEFAULT_LIMITS)
        eng = engine(provider.url)
        service.add_engine(eng)
        run_ = await service.begin(conversation())
        try:
            with pytest.raises(ApiError) as caught:
                await run_.open()
            return caught.value, service.models["up"].queue.running
        finally:
            await eng.aclose()

    error, running = run(go())
    assert error.status == 429 and error.code == "rate_limited" and error.headers["Retry-After"] == "7"
    assert running == 0, "a refused run must give its queue slot back"


# What each server answers (HTTP 400) to a prompt longer than its window.
CONTEXT_OVERFLOW_BODIES = {
    "openai": {"error": {"message": "This model's maximum context length is 128000 tokens.",
                         "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}},
    "llama-server": {"error": {"code": 400, "message": "request (4476 tokens) exceeds the available context size "
                               "(4096 tokens), try increasing it", "type": "exceed_context_size_error",
                               "n_prompt_tokens": 4476, "n_ctx": 4096}},
    "vllm": {"error": {"message": "This model's maximum context length is 4096 tokens. However, you requested "
                       "4476 tokens in the messages, Please reduce the length of the messages.",
                       "type": "BadRequestError", "param": None, "code": 400}},
    "vllm-v1": {"object": "error", "message": "The decoder prompt (length 4476) is longer than the maximum model "
                "length of 4096. Make sure that `max_model_len` is no smaller than the number of text tokens.",
                "type": "BadRequestError", "param": None, "code": 400},
    "sglang": {"object": "error", "message": "The input (4476 tokens) is longer than the model's context length "
               "(4096 tokens).", "type": "BadRequestError", "param": None, "code": 400},
}


@pytest.mark.parametrize("server", list(CONTEXT_OVERFLOW_BODIES))
def test_each_server_s_context_overflow_is_context_length_exceeded(provider, server):
    """Only the code reaches the client; the provider's words stay in the log."""
    provider.push(Reply(status=400, content_type="application/json",
                        body=json.dumps(CONTEXT_OVERFLOW_BODIES[server]).encode()))

    async def go():
        eng = engine(provider.url)
        try:
            with pytest.raises(ApiError) as caught:
                await eng.open(eng.prepare(conversation()), CancelToken())
            return caught.value
        finally:
            await eng.aclose()

    error = run(go())
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert "4096" not in error.message and "128000" not in error.message


def test_service_runs_many_upstream_generations_at_once(provider):
    provider.responder = lambda request: Reply(parts=text_stream("ok"), pace_s=0.05)

    async def go():
        service = Service(DEFAULT_LIMITS)
        eng = engine(provider.url, max_concurrency=8)
        service.add_engine(eng)
        try:
            runs = [await service.begin(conversation()) for _ in range(8)]
            assert service.models["up"].queue.running == 8 and service.models["up"].queue.pending == 0
            started = time.monotonic()
            outs = await asyncio.gather(*(collect_run(r) for r in runs))
            return outs, time.monotonic() - started
        finally:
            await eng.aclose()

    async def collect_run(r):
        await r.open()
        return [e async for e in r.engine.generate(r.prepared, r.cancel)]

    try:
        outs, elapsed = run(go())
    finally:
        provider.responder = None
    assert all(isinstance(o[-1], Finished) for o in outs)
    # One stream takes ~0.25 s; eight in sequence would take 2 s.
    assert elapsed < 1.5


def test_shutdown_interrupts_a_stalled_read_and_closes_the_provider(provider):
    (reply,) = provider.push(Reply(parts=[text_chunk("partial")], stall_s=30))

    async def go():
        eng = engine(provider.url)
        cancel = CancelToken()
        prepared = eng.prepare(conversation())
        events = []
        try:
            async for event in eng.generate(prepared, cancel):
                events.append(event)
                if isinstance(event, TextDelta):
                    asyncio.get_running_loop().call_later(0.1, cancel.cancel, "shutdown")
            return events
        finally:
            await eng.aclose()

    started = time.monotonic()
    events = run(go())
    assert time.monotonic() - started < 3
    assert events[-1] == Failed("server_shutting_down", "The server is shutting down.")
    assert reply.disconnected.wait(5)


def test_client_cancel_is_a_cancelled_finish(provider):
    provider.push(Reply(parts=[text_chunk("partial")], stall_s=30))

    async def go():
        eng = engine(provider.url)
        cancel = CancelToken()
        try:
            prepared = eng.prepare(conversation())
            out = []
            async for event in eng.generate(prepared, cancel):
                out.append(event)
                cancel.cancel()
            return out
        finally:
            await eng.aclose()

    events = run(go())
    assert events[-1] == Finished("cancelled")


def test_dropping_the_consumer_closes_the_provider_stream(provider):
    (reply,) = provider.push(Reply(parts=[text_chunk("tick")] * 200, pace_s=0.02))

    async def go():
        eng = engine(provider.url)
        try:
            prepared = eng.prepare(conversation())

            async def consume():
                async for _ in eng.generate(prepared, CancelToken()):
                    pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert eng.pool.endpoints[0].outstanding == 0
        finally:
            await eng.aclose()

    run(go())
    assert reply.disconnected.wait(5)


def test_connect_failure_fails_over_to_the_next_endpoint(provider):
    provider.push(Reply(parts=text_stream("from the live one")))

    async def go():
        eng = engine(dead_url(), provider.url)
        try:
            events = await collect(eng, conversation())
            return events, eng.pool.snapshot()
        finally:
            await eng.aclose()

    events, endpoints = run(go())
    assert isinstance(events[-1], Finished)
    assert endpoints[0]["healthy"] is False and endpoints[1]["healthy"] is True


def test_no_reachable_endpoint_is_a_clear_refusal():
    async def go():
        eng = engine(dead_url(), dead_url())
        try:
            with pytest.raises(ApiError) as caught:
                await eng.open(eng.prepare(conversation()), CancelToken())
            return caught.value
        finally:
            await eng.aclose()

    error = run(go())
    assert error.code == "upstream_unavailable" and error.status == 502


def test_prompt_cache_key_keeps_affinity(provider, provider2):
    for p in (provider, provider2):
        p.responder = lambda request: Reply(parts=text_stream("ok"))

    async def go():
        eng = engine(provider.url, provider2.url)
        try:
            for key in ("thread-a", "thread-b", "thread-c", "thread-d"):
                for _ in range(3):
                    await collect(eng, conversation(prompt_cache_key=key))
        finally:
            await eng.aclose()

    try:
        run(go())
    finally:
        provider.responder = provider2.responder = None
    total = len(provider.requests) + len(provider2.requests)
    assert total == 12
    # Each key's three requests went to one provider.
    assert len(provider.requests) % 3 == 0 and len(provider2.requests) % 3 == 0


def test_health_probe_marks_endpoints(provider):
    async def go():
        eng = engine(provider.url, dead_url(), health_interval_s=0)
        try:
            live, dead = eng.pool.endpoints
            assert await eng.client.probe(live) is True and live.healthy
            assert await eng.client.probe(dead) is False and not dead.healthy
            # Every failed probe pushes the next try further out.
            first_retry = dead.retry_at
            assert await eng.client.probe(dead) is False and dead.failures == 2 and dead.retry_at > first_retry
            provider.model_list_status = 503
            assert await eng.client.probe(live) is False and not live.healthy
        finally:
            provider.model_list_status = 200
            await eng.aclose()

    run(go())


def test_a_provider_echoing_the_key_as_call_id_is_rewritten(provider):
    key = "sk-test-echoed-key-123"
    provider.push(Reply(parts=tool_stream("lookup", {"q": 1}, call_id=key)))

    async def go():
        eng = engine(provider.url, key=key)
        try:
            conv = conversation(tools=[FunctionTool(name="lookup", parameters={"type": "object"})])
            return await collect(eng, conv)
        finally:
            await eng.aclose()

    events = run(go())
    (started,) = [e for e in events if isinstance(e, ToolCallStarted)]
    assert key not in started.call_id
    assert provider.requests[-1].headers["authorization"] == f"Bearer {key}"


def test_calls_of_namespace_members_carry_the_plain_name_and_the_namespace(provider):
    """The provider calls what it was offered, the qualified name; the call
    the client gets is the member's own name and its namespace, for a
    function and for a custom tool alike (as the llama engine's)."""
    tools = [FunctionTool(name="functions__exec_command", namespace="functions"),
             CustomTool(name="functions__apply_patch", namespace="functions")]
    provider.push(Reply(parts=tool_stream("functions__exec_command", {"cmd": "ls"})))
    provider.push(Reply(parts=tool_stream("functions__apply_patch", {"input": "*** Begin Patch"})))

    async def go():
        eng = engine(provider.url)
        try:
            return [await collect(eng, conversation(tools=tools)) for _ in range(2)]
        finally:
            await eng.aclose()

    started = [[(e.name, e.kind, e.namespace) for e in events if isinstance(e, ToolCallStarted)]
               for events in run(go())]
    assert started == [[("exec_command", "function", "functions")], [("apply_patch", "custom", "functions")]]


def test_stats_and_info_never_hold_the_key(provider):
    key = "sk-test-not-in-stats"
    eng = engine(provider.url, key=key)
    assert key not in repr(eng.stats()) and key not in repr(eng.info) and key not in repr(eng.spec)


class QueryRecordingProvider(ScriptedProvider):
    """The scripted provider, also noting each request's path and query."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    async def _chat(self, request):
        self.seen.append((request.url.path, request.url.query))
        return await super()._chat(request)

    async def _models(self, request):
        self.seen.append((request.url.path, request.url.query))
        return await super()._models(request)


def test_a_base_url_with_a_query_keeps_it_after_each_path():
    """Azure's ``?api-version=``: the query follows the path each request
    adds (it once went before it, and every request missed the route); the
    URL shown in stats and logs still leaves it out."""
    provider = QueryRecordingProvider().start()
    provider.push(Reply(parts=text_stream("Hello!")))

    async def go():
        eng = engine(provider.url + "?api-version=2024-06-01")
        try:
            events = await collect(eng, conversation())
            healthy = await eng.client.probe(eng.pool.endpoints[0])
            return events, healthy, eng.stats(), eng.info.source
        finally:
            await eng.aclose()

    try:
        events, healthy, stats, source = run(go())
    finally:
        provider.stop()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello!"
    assert isinstance(events[-1], Finished) and healthy
    query = "api-version=2024-06-01"
    assert provider.seen == [("/v1/chat/completions", query), ("/v1/models", query)]
    assert "api-version" not in repr(stats) and "api-version" not in source


ECHOED_KEYS = ["sk-live-A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0",
               "sk-live-A1b2C3d4\\E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0"]  # a backslash: repr and JSON escape it


def leaked(key: str, text: str) -> bool:
    """Any 20 characters of ``key``, as is or escaped, in ``text``."""
    spellings = (key, key.replace("\\", "\\\\"))
    return any(s[i:i + 20] in text for s in spellings for i in range(len(s) - 19))


@pytest.mark.parametrize("key", ECHOED_KEYS)
@pytest.mark.parametrize("pad", [100, 970])  # 970: the echoed key straddles the 1024-char cut
@pytest.mark.parametrize("where", ["http_error", "in_stream"])
def test_a_provider_echoing_the_key_in_its_error_text_never_gets_it_logged(provider, caplog, key, pad, where):
    said = "x" * pad + f" Authorization: Bearer {key} was refused"
    if where == "http_error":
        provider.push(Reply(status=401, content_type="application/json",
                            body=json.dumps({"error": {"message": said, "type": "authentication_error"}}).encode()))
    else:
        provider.push(Reply(parts=[text_chunk("hi"), sse({"error": {"message": said, "type": "server_error"}})]))

    async def go():
        eng = engine(provider.url, key=key)
        try:
            return await collect(eng, conversation())
        except ApiError as exc:
            return exc
        finally:
            await eng.aclose()

    with caplog.at_level(logging.INFO):
        outcome = run(go())
    if where == "http_error":
        assert isinstance(outcome, ApiError) and outcome.code == "upstream_http_error"
    else:
        assert isinstance(outcome[-1], Failed) and outcome[-1].code == "upstream_provider_error"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "x" * 100 in logged, "the provider's text is logged, the key scrubbed out of it"
    assert not leaked(key, logged)


def test_connection_is_kept_after_a_clean_end_and_dropped_after_trailing_noise(provider):
    """After [DONE] the rest of the body is let go by unread in the
    background so the connection serves the next request; a provider that
    keeps talking past the drain bound loses its connection instead."""
    noise = [b": noise\n\n" * 10_000]  # ~90 KiB after [DONE], over the 64 KiB bound
    # The pauses make the body end well after [DONE] has been read.
    provider.push(Reply(parts=text_stream("one")), Reply(parts=text_stream("two") + [0.05]),
                  Reply(parts=text_stream("three") + [0.05] + noise), Reply(parts=text_stream("four")))

    async def go():
        eng = engine(provider.url)
        texts = []
        try:
            for _ in range(4):
                events = await collect(eng, conversation())
                texts.append("".join(e.text for e in events if isinstance(e, TextDelta)))
                while eng.client._drains:  # the drain runs after the terminal event
                    await asyncio.sleep(0.01)
        finally:
            await eng.aclose()
        return texts

    assert run(go()) == ["one", "two", "three", "four"]
    ports = [r.client_port for r in provider.requests]
    assert ports[0] == ports[1] == ports[2] != ports[3]


def test_the_body_is_the_same_json_and_routes_on_its_messages():
    from lmspd.engines.upstream.engine import _dumps

    eng = UpstreamEngine(UpstreamSpec(served_model="up", upstream_model="m", urls=["http://h/v1"]))
    tool = FunctionTool(name="lookup", parameters={"type": "object", "properties": {"q": {"type": "string"}}})
    for conv in (conversation("héllo"), conversation("x", tools=[tool], max_output_tokens=5, instructions="be brief")):
        prepared = eng.prepare(conv)
        assert prepared.body == _dumps(prepared.request.body).encode()
        prompt = bytes(prepared.route_prompt)
        assert prepared.body.startswith(prompt) and prompt.endswith(b"}")
        assert b'"tools"' not in prompt and b'"stream"' not in prompt
    # A later turn's routed prompt extends the earlier one's.
    one = eng.prepare(conversation("first"))
    two = eng.prepare(Conversation(model="up", items=[Message(role="user", text="first"),
                                                      Message(role="assistant", text="ok"),
                                                      Message(role="user", text="second")]))
    assert bytes(two.route_prompt).startswith(bytes(one.route_prompt))
    # Other tools: another prefix (templates render tools first).
    assert eng.prepare(conversation("first", tools=[tool])).route_seed != one.route_seed


def test_continuations_and_sessions_stay_on_their_endpoint(provider, provider2):
    for p in (provider, provider2):
        p.responder = lambda request: Reply(parts=text_stream("ok"))

    async def turn(eng, response_id, session_key=None, **kw):
        prepared = eng.prepare(conversation(**kw), RunContext(session_key=session_key))
        prepared.response_id = response_id
        return [e async for e in eng.generate(prepared, CancelToken())]

    async def go():
        eng = engine(provider.url, provider2.url)
        try:
            await turn(eng, "resp_1", text="start one")
            first = 0 if provider.requests else 1
            await turn(eng, "resp_2", text="start two")  # the other endpoint: least loaded
            for i in range(3):
                await turn(eng, f"resp_1{i}", text=f"more {i}", previous_response_id="resp_1" if i == 0 else f"resp_1{i - 1}")
            await turn(eng, "resp_s1", text="a", session_key="codex-thread")
            await turn(eng, "resp_s2", text="b", session_key="codex-thread")
            return first, eng.stats()["routing"]
        finally:
            await eng.aclose()

    try:
        first, routing = run(go())
    finally:
        provider.responder = provider2.responder = None
    home, other = (provider, provider2) if first == 0 else (provider2, provider)
    texts = lambda p: [r.body["messages"][-1]["content"] for r in p.requests]  # noqa: E731
    assert texts(home)[:4] == ["start one", "more 0", "more 1", "more 2"]
    assert texts(other)[0] == "start two"
    assert routing["routes"]["affinity"] == 3 and routing["routes"]["session"] == 1
    assert routing["pinned_sessions"] == 1


def test_routing_state_is_per_owner(provider, provider2):
    # The run's owner reaches the router: one API key's prompts and session
    # keys never steer another key's requests (routing.py, "Owners").
    for p in (provider, provider2):
        p.responder = lambda request: Reply(parts=text_stream("ok"))
    secret = "A's confidential system prompt: the merger with ACME closes on 2026-03-01. " * 20

    async def turn(eng, owner, text, system=None, **kw):
        items = ([Message(role="system", text=system)] if system else []) + [Message(role="user", text=text)]
        events = await collect(eng, Conversation(model="up", items=items, **kw), run=RunContext(owner=owner))
        assert isinstance(events[-1], Finished)

    async def go():
        eng = engine(provider.url, provider2.url, health_interval_s=0)
        try:
            await turn(eng, "key-A", "hello", system=secret)
            await turn(eng, "key-B", "guess", system=secret)  # not route=prefix: key-A's prompt
            await turn(eng, "key-A", "hello again", system=secret)  # route=prefix: its own
            await turn(eng, "key-A", "one", prompt_cache_key="team-42")
            await turn(eng, "key-B", "two", prompt_cache_key="team-42")  # not route=session: key-A's key
            await turn(eng, "key-A", "three", prompt_cache_key="team-42")  # route=session: its own
            return eng.stats()["routing"]
        finally:
            await eng.aclose()

    try:
        routing = run(go())
    finally:
        provider.responder = provider2.responder = None
    assert routing["routes"]["prefix"] == 1 and routing["routes"]["session"] == 1
    assert routing["routes"]["least-loaded"] == 4 and routing["pinned_sessions"] == 2


def test_a_refused_connection_moves_the_session_once(provider, caplog):
    provider.responder = lambda request: Reply(parts=text_stream("ok"))

    async def go():
        eng = engine(dead_url(), provider.url, health_interval_s=0)
        try:
            dead, live = eng.pool.endpoints
            # Pin the session to the dead endpoint, as if it had served it.
            eng.router._sessions.set(("local", "s"), dead.index)
            with caplog.at_level(logging.INFO, logger="lmspd.upstream.routing"):
                for text in ("one", "two", "three"):
                    events = await collect(eng, conversation(text), run=RunContext(session_key="s"))
                    assert isinstance(events[-1], Finished)
            return eng.stats()["routing"], dead.label, live.label
        finally:
            await eng.aclose()

    try:
        routing, dead, live = run(go())
    finally:
        provider.responder = None
    assert len(provider.requests) == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "lmspd.upstream.routing"]
    assert lines[0] == f"route=session endpoint={dead} matched=0 model=up"
    assert lines[1].startswith(f"route=least-loaded endpoint={live} ") and f"moved_from={dead}" in lines[1]
    assert all(line.startswith(f"route=session endpoint={live} ") for line in lines[2:]) and len(lines) == 4
    assert routing["moved"] == 1


def test_a_stream_dropped_midway_marks_its_endpoint_down_and_moves_the_session(provider):
    provider.responder = lambda request: Reply(parts=text_stream("ok"))

    async def dying(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # An endpoint that dies mid-stream: headers, one event, then gone.
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        event = text_stream("half")[1]
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        writer.transport.abort()

    async def go():
        server = await asyncio.start_server(dying, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        eng = engine(f"http://127.0.0.1:{port}/v1", provider.url, health_interval_s=0)
        try:
            dying_endpoint = eng.pool.endpoints[0]
            eng.router._sessions.set(("local", "s"), dying_endpoint.index)
            first = await collect(eng, conversation("one"), run=RunContext(session_key="s"))
            second = await collect(eng, conversation("two"), run=RunContext(session_key="s"))
            return first, second, dying_endpoint.healthy, eng.stats()["routing"]
        finally:
            await eng.aclose()
            server.close()

    try:
        first, second, healthy, routing = run(go())
    finally:
        provider.responder = None
    assert isinstance(first[-1], Failed) and first[-1].code == "upstream_connection_lost"
    assert isinstance(second[-1], Finished) and not healthy
    assert routing["moved"] == 1 and len(provider.requests) == 1
