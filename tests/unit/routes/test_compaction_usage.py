"""What a compaction reports as its usage. ``/v1/responses/compact``: the
summary's, in the shape of a Response's usage (the SDK's CompactedResponse
requires ``input_tokens_details.cache_write_tokens``). A turn that compacts
(a ``compaction_trigger``, or ``context_management``'s threshold crossed):
the summary it wrote, plus its own run's -- never only the latter, which
for a trigger is nothing at all. In process, with every run of the scripted
engine reporting the same usage."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import CompactedResponse, Response

from lmspd.core.events import Usage
from support.inprocess import MODEL, ScriptedEngine, serving

RUN = Usage(input_tokens=40, output_tokens=7, cached_tokens=5, cache_write_tokens=3, reasoning_tokens=2)


def reported(times: int) -> dict:
    return {"input_tokens": RUN.input_tokens * times,
            "input_tokens_details": {"cached_tokens": RUN.cached_tokens * times,
                                     "cache_write_tokens": RUN.cache_write_tokens * times},
            "output_tokens": RUN.output_tokens * times,
            "output_tokens_details": {"reasoning_tokens": RUN.reasoning_tokens * times},
            "total_tokens": RUN.total_tokens * times}


@pytest.fixture
def app(tmp_path):
    with serving(tmp_path, engine=ScriptedEngine(usage=RUN)) as app:
        yield app


def test_compact_reports_the_summarys_usage_in_the_sdks_shape(app):
    r = app.http.post("/v1/responses/compact", json={"model": MODEL, "input": "a long story"})
    assert r.status_code == 200, r.text
    # CompactedResponse's usage type (its output type has no user message,
    # which OpenAI's compaction output holds too).
    CompactedResponse.model_fields["usage"].annotation.model_validate(r.json()["usage"])
    assert r.json()["usage"] == reported(1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_compaction_trigger_turn_reports_its_summary(app, stream):
    body = {"model": MODEL, "store": False, "stream": stream,
            "input": [{"role": "user", "content": "a long story"}, {"type": "compaction_trigger"}]}
    generations = app.generations()
    if stream:
        with app.http.stream("POST", "/v1/responses", json=body) as r:
            done = [line for line in r.iter_lines() if line.startswith("data:") and "response.completed" in line]
        response = json.loads(done[-1][5:])["response"]
        Response.model_validate(response)
    else:
        r = app.http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        response = r.json()
    # The summary is the one run of the turn (this engine cannot prefill).
    assert app.generations() == generations + 1
    assert [i["type"] for i in response["output"]] == ["compaction"]
    assert response["usage"] == reported(1)


def test_a_turn_over_its_compaction_threshold_reports_the_summary_and_the_answer(app):
    r = app.http.post("/v1/responses", json={
        "model": MODEL, "store": False, "input": "a long story",
        "context_management": [{"type": "compaction", "compact_threshold": 1}]})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    assert [i["type"] for i in r.json()["output"]] == ["compaction", "message"]
    assert r.json()["usage"] == reported(2)
