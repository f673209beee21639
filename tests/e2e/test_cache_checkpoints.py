"""Exact-state checkpoints on a model whose KV cannot be trimmed: Gemma 3
270M, whose sliding-window layers keep only their last window of cells
(llama.cpp's default, ``--swa-full`` off). A turn that diverges from a
remembered state more than a window before its end cannot cut that state
short; it resumes from the nearest checkpoint at or before the divergence
(the end of an input, the end of a turn) and prefills only from there.
Asserted from the cache log line of each response."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import llama_cpp
import pytest

from lmspd.engines.llama.models import resolve_model
from support.server import ServerProcess

GEMMA = "gemma3-270m"
# Gemma 3's template with a <think> block opened by the generation prompt.
THINKING_GEMMA = str(Path(__file__).parent.parent / "fixtures" / "thinking_gemma3.jinja")
COLOURS = ["red", "green", "blue", "amber", "violet", "grey", "white", "black"]
ANIMALS = ["otter", "heron", "badger", "lynx", "marten", "ibis", "vole", "wren"]


def document(tag: str, n: int = 80) -> str:
    """About 11 tokens a sentence: ``n`` = 80 is well over one 512-token window."""
    return " ".join(f"{tag} note {i}: the {COLOURS[i % 8]} {ANIMALS[(i * 3) % 8]} crossed river {i * 7}."
                    for i in range(n))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    server = ServerProcess("--model", GEMMA, "--ctx", "4096", "--parallel", "4",
                           "--kv-disk-dir", str(tmp_path_factory.mktemp("kv"))).start(timeout=180)
    yield server
    server.stop()


def post(server, body):
    r = httpx.post(server.url + "/v1/responses",
                   json={"model": GEMMA, "temperature": 0, "store": False, **body}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def cache_line(server, response_id):
    m = server.wait_for_log(rf"generation response={re.escape(response_id)} seq=\d+ cache_source=(\S+)(.*?) "
                            r"reused=(\d+) prefilled=(\d+)")
    return {"source": m.group(1), "detail": m.group(2).strip(), "reused": int(m.group(3)),
            "prefilled": int(m.group(4))}


def user(text):
    return {"role": "user", "content": text}


def two_turns(server, tag):
    """Turn 1: instructions and a short question. Turn 2: a long document."""
    items = [{"role": "system", "content": f"You are {tag}'s terse assistant."}, user(f"{tag}: say hello.")]
    first = post(server, {"input": items, "max_output_tokens": 6})
    items = items + first["output"] + [user(document(tag) + " Summarize it.")]
    second = post(server, {"input": items, "max_output_tokens": 4})
    return items, first, second


def test_kv_is_reported_non_trimmable(gemma):
    cache = gemma.health()["models"][GEMMA]["cache"]
    assert cache["kv"] == "swa"


def test_branch_edit_of_last_user_turn_resumes_from_turn_checkpoint(gemma):
    items, _first, second = two_turns(gemma, "Ada")
    turn2 = cache_line(gemma, second["id"])
    # An edit at the start of the long last user turn: more than a window
    # before the end of the state, which cannot be cut back there.
    edited = items[:-1] + [user("Edited. " + document("Ada") + " Summarize it.")]
    branch = post(gemma, {"input": edited, "max_output_tokens": 4})
    line = cache_line(gemma, branch["id"])
    assert line["source"] == "checkpoint" and "at=response" in line["detail"], line
    # Only the edited turn is prefilled; turn 1 comes from its checkpoint.
    assert line["reused"] >= turn2["reused"] - 2, (line, turn2)
    assert line["prefilled"] <= turn2["prefilled"] + 8, (line, turn2)


def test_replay_that_drops_a_hidden_part_resumes_from_input_checkpoint(gemma):
    """Turn 3 replays turn 1's answer without the part of it the model
    produced but the client never saw (as a replay without hidden reasoning
    does): the divergence is the end of turn 1's input."""
    doc = document("Bo")
    items = [user(doc + " Reply with one word.")]
    first = post(gemma, {"input": items, "max_output_tokens": 8})
    turn1 = cache_line(gemma, first["id"])
    items2 = items + first["output"] + [user(document("Bo-2") + " And now?")]
    second = post(gemma, {"input": items2, "max_output_tokens": 4})
    shown = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fine."}]}]
    replay = items + shown + items2[len(items) + len(first["output"]):] + second["output"] + [user("Last one.")]
    third = post(gemma, {"input": replay, "max_output_tokens": 4})
    line = cache_line(gemma, third["id"])
    assert line["source"] == "checkpoint" and "at=input" in line["detail"], line
    assert line["reused"] == turn1["reused"] + turn1["prefilled"], (line, turn1)


def test_four_concurrent_sessions_each_resume_from_their_checkpoint(gemma):
    results: dict[str, object] = {}

    def session(tag):
        try:
            items, _first, second = two_turns(gemma, tag)
            edited = items[:-1] + [user("Edited. " + document(tag) + " Summarize it.")]
            branch = post(gemma, {"input": edited, "max_output_tokens": 4})
            results[tag] = (cache_line(gemma, second["id"]), cache_line(gemma, branch["id"]))
        except BaseException as exc:  # reported below, in the test's thread
            results[tag] = exc

    threads = [threading.Thread(target=session, args=(tag,)) for tag in ("Cy", "Di", "Ed", "Flo")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    for tag, result in results.items():
        assert not isinstance(result, BaseException), (tag, result)
        turn2, line = result  # type: ignore[misc]
        assert line["source"] == "checkpoint" and "at=response" in line["detail"], (tag, line)
        assert line["prefilled"] <= turn2["prefilled"] + 8, (tag, line, turn2)
    assert len(results) == 4


def test_partial_reuse_of_a_ram_state(tmp_path):
    """One sequence: session A goes to RAM when B runs. An edit near A's end
    (inside the window) trims the RAM state itself; an edit more than a
    window back resumes from A's turn-1 checkpoint instead."""
    srv = ServerProcess("--model", GEMMA, "--ctx", "4096", "--parallel", "1", "--kv-disk-space-mb", "0").start(
        timeout=180)
    try:
        items, _first, second = two_turns(srv, "Gus")
        turn2 = cache_line(srv, second["id"])
        post(srv, {"input": "Something unrelated.", "max_output_tokens": 2})
        near = items[:-1] + [user(document("Gus") + " Summarize it in French.")]
        r = post(srv, {"input": near, "max_output_tokens": 2})
        line = cache_line(srv, r["id"])
        assert line["source"] == "ram" and line["detail"] == "partial", line
        assert line["prefilled"] < 20, line
        post(srv, {"input": "Something else unrelated.", "max_output_tokens": 2})
        far = items[:-1] + [user("Edited. " + document("Gus") + " Summarize it.")]
        r = post(srv, {"input": far, "max_output_tokens": 2})
        line = cache_line(srv, r["id"])
        assert line["source"] == "checkpoint" and "from=ram" in line["detail"], line
        assert line["prefilled"] <= turn2["prefilled"] + 8, (line, turn2)
    finally:
        srv.stop()


def test_far_edit_with_no_checkpoint_before_it_is_checkpoint_missing(gemma):
    """An edit at the start of a one-turn conversation's long input: no
    checkpoint lies at or before it and the state cannot be cut back there,
    so the turn is prefilled again — and the response says why."""
    doc = document("Hal", 110)  # over the 1024 cells a sliding-window stream keeps
    first = post(gemma, {"input": [user(doc + " One word.")], "max_output_tokens": 2})
    again = post(gemma, {"input": [user("Edited. " + doc + " One word.")], "max_output_tokens": 2})
    cache = again["extensions"]["lmspd.cache"]
    assert cache["miss_reason"] == "checkpoint_missing", cache
    assert cache["divergence"]["item"] == 0 and cache["divergence"]["token"] < 16, cache
    assert cache["reused"] == 0 and cache["prefilled"] > first["usage"]["input_tokens"], cache


def test_a_request_diverging_right_after_a_client_breakpoint_resumes_from_it(gemma):
    """``prompt_cache_breakpoint`` on the first content part of the developer
    prompt: the first request's prefill stops there for an exact-state
    checkpoint, so a second request whose developer prompt differs after that
    part restores it and prefills only what follows. Without it the first
    state, whose long question follows the breakpoint by more than a window,
    cannot be cut back there (and the developer prompt's own end, an implicit
    checkpoint, is not shared), so the second request would be a cold prefill."""
    notes = "Answer from these notes. " + document("Ivo", 40)

    def developer(style):
        return {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": notes, "prompt_cache_breakpoint": {"mode": "explicit"}},
            {"type": "input_text", "text": f" Answer {style}."}]}

    first = post(gemma, {"input": [developer("tersely"), user(document("Jo", 110) + " Which animal crossed river 7?")],
                         "max_output_tokens": 2})
    second = post(gemma, {"input": [developer("in one word"), user("Name every colour in the notes, please.")],
                          "max_output_tokens": 2})
    line = cache_line(gemma, second["id"])
    assert line["source"] == "checkpoint" and "at=breakpoint" in line["detail"], line
    # Everything up to the breakpoint came from the checkpoint: only the rest
    # of the developer prompt, the question and the turn's markup were prefilled.
    assert line["reused"] >= 400 and line["prefilled"] < 40, line
    assert first["usage"]["input_tokens"] > line["reused"] + 1024


def test_a_new_session_sharing_only_the_developer_prompt_resumes_from_its_end(gemma):
    """No breakpoint declared (Codex and most agents declare none): the end of
    the developer prompt is an implicit checkpoint on a non-trimmable KV, so a
    second session with the same developer prompt and another question
    prefills only its question, though the first state cannot be cut back."""
    developer = {"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "Answer from these notes. " + document("Una", 40)}]}
    first = post(gemma, {"input": [developer, user(document("Kai", 110) + " Which animal crossed river 14?")],
                         "max_output_tokens": 2})
    second = post(gemma, {"input": [developer, user("Name every animal in the notes, please.")],
                          "max_output_tokens": 2})
    line = cache_line(gemma, second["id"])
    assert line["source"] == "checkpoint" and "at=breakpoint" in line["detail"], line
    assert line["reused"] >= 400 and line["prefilled"] < 30, line
    assert first["usage"]["input_tokens"] > line["reused"] + 1024


def post_messages(server, body):
    r = httpx.post(server.url + "/v1/messages", json={"model": GEMMA, "temperature": 0, "max_tokens": 2, **body},
                   timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def resumed_at_breakpoint(server, response_id, at_least):
    """The request restored a breakpoint checkpoint holding ``at_least``
    tokens and prefilled only its short rest."""
    line = cache_line(server, response_id)
    assert line["source"] == "checkpoint" and "at=breakpoint" in line["detail"], line
    assert line["reused"] >= at_least and line["prefilled"] < 40, line
    return line


LOOKUP = {"name": "lookup", "description": "Looks up the field notes.", "input_schema": {"type": "object"}}
MARK = {"type": "ephemeral"}


def test_a_request_diverging_right_after_a_marked_tool_result_resumes_from_it(gemma):
    """Anthropic ``cache_control`` on a ``tool_result`` block: the first
    request's prefill stops at the end of that result for a checkpoint, so a
    second request with the same result and another question after it
    prefills only the question. Without the mark the first state, whose long
    question follows the result by more than a window, cannot be cut back
    there, and no other checkpoint lies near it: a cold prefill."""
    notes = "Field notes. " + document("Lev", 40)

    def messages(question, mark=True):
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": notes}
        if mark:
            result["cache_control"] = MARK
        return [{"role": "user", "content": "Look the notes up, then answer."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]},
                {"role": "user", "content": [result, {"type": "text", "text": question}]}]

    first = post_messages(gemma, {"tools": [LOOKUP], "messages": messages(document("Mia", 110) + " Which animal?")})
    second = post_messages(gemma, {"tools": [LOOKUP], "messages": messages("Name every colour in the notes.")})
    resumed_at_breakpoint(gemma, second["id"], at_least=400)
    assert first["usage"]["input_tokens"] > second["usage"]["cache_read_input_tokens"] + 1024


def test_a_request_diverging_right_after_marked_tools_resumes_from_their_end(gemma):
    """Anthropic ``cache_control`` on a tool: the end of the rendered tool
    definitions (in Gemma's first user turn, which has no system role) is a
    checkpoint, so a request with the same tools and another first message
    prefills only that message."""
    tools = [{"name": f"tool_{i}", "description": document(f"T{i}", 12), "input_schema": {"type": "object"}}
             for i in range(3)]
    tools[-1] = {**tools[-1], "cache_control": MARK}
    first = post_messages(gemma, {"tools": tools,
                                  "messages": [user(document("Ned", 110) + " Which tool fits best?")]})
    second = post_messages(gemma, {"tools": tools, "messages": [user("Which tool is the first one?")]})
    resumed_at_breakpoint(gemma, second["id"], at_least=300)
    assert first["usage"]["input_tokens"] > second["usage"]["cache_read_input_tokens"] + 1024


def test_a_request_diverging_right_after_a_marked_function_call_output_resumes_from_it(gemma):
    """Responses: ``prompt_cache_breakpoint`` on an ``input_text`` part of a
    ``function_call_output`` (the OpenAI SDK's shape) is a checkpoint too."""
    notes = "Field notes. " + document("Oda", 40)
    tool = {"type": "function", "name": "lookup", "description": "Looks up the field notes.",
            "parameters": {"type": "object", "properties": {}}}

    def items(question):
        return [user("Look the notes up, then answer."),
                {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": [
                    {"type": "input_text", "text": notes, "prompt_cache_breakpoint": {"mode": "explicit"}}]},
                user(question)]

    first = post(gemma, {"tools": [tool], "input": items(document("Pia", 110) + " Which animal?"),
                         "max_output_tokens": 2})
    second = post(gemma, {"tools": [tool], "input": items("Name every colour in the notes."),
                          "max_output_tokens": 2})
    line = resumed_at_breakpoint(gemma, second["id"], at_least=400)
    assert first["usage"]["input_tokens"] > line["reused"] + 1024


def test_a_sealed_replay_with_an_edited_answer_resumes_from_the_end_of_reasoning():
    """Gemma under a thinking-style template (a fixture derived from its own).
    Turn 1 reasons until effort ``minimal``'s budget runs out (lmspd writes
    the close), then answers at length: the state ends far more than a
    window past the end of the reasoning, so it cannot be cut back there.
    Turn 2 replays turn 1 with its sealed reasoning (which renders exactly
    what the model saw) but an edited answer, and a new question: it
    restores the end-of-reasoning checkpoint and prefills only the edited
    answer and what follows. Without that checkpoint the nearest one is the
    end of turn 1's input, and the reasoning would be prefilled again.
    The repetition guard is off so that the answer's length depends on the
    model's own end of turn only (a small model at temperature 0 may fall
    into a loop, which the guard would end early)."""
    srv = ServerProcess("--model", GEMMA, "--ctx", "4096", "--parallel", "1", "--kv-disk-space-mb", "0",
                        "--chat-template", THINKING_GEMMA, "--repetition-window", "0").start(timeout=180)
    try:
        items = [{"role": "developer", "content": "Answer from these notes. " + document("Rex", 40)},
                 user("Count from 1 to 300, one number per line.")]
        think = {"reasoning": {"effort": "minimal"}, "include": ["reasoning.encrypted_content"]}
        first = post(srv, {"input": items, "max_output_tokens": 660, **think})
        reasoning, answer = first["output"][0], first["output"][1]
        assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"], first["output"]
        assert answer["type"] == "message" and answer["content"][0]["text"], first["output"]
        usage = first["usage"]
        assert usage["output_tokens_details"]["reasoning_tokens"] == 16, usage  # minimal's budget: lmspd closed it
        # Over 512 tokens of answer, in a state over the 1024 cells a
        # sliding-window stream keeps: it can be cut back 512 tokens at
        # most, so its floor lies past the end of the reasoning.
        assert usage["output_tokens"] > 16 + 600 and usage["total_tokens"] > 1024 + 100, usage
        turn1 = cache_line(srv, first["id"])
        assert turn1["reused"] + turn1["prefilled"] == usage["input_tokens"]

        edited = {"type": "message", "role": "assistant",
                  "content": [{"type": "output_text", "text": "1, 2, 3 and so on up to 300."}]}
        second = post(srv, {"input": items + [reasoning, edited, user("Now count down from 5.")],
                            "max_output_tokens": 4, **think})
        line = cache_line(srv, second["id"])
        assert line["source"] == "checkpoint" and "at=reasoning" in line["detail"], line
        # The checkpoint holds turn 1's prompt, its 16 reasoning tokens and
        # the close lmspd wrote: everything before the edited answer.
        vocab = llama_cpp.Llama(str(resolve_model(GEMMA)[1]), vocab_only=True, verbose=False)

        def count(text):
            return len(vocab.tokenize(text.encode(), add_bos=False, special=True))

        assert line["reused"] == usage["input_tokens"] + 16 + count("\n</think>\n\n"), (line, usage)
        assert second["usage"]["input_tokens_details"]["cached_tokens"] == line["reused"]
        # Prefilled: the rest of the replay as the fixture renders it, tokenized on its own.
        rest = ("1, 2, 3 and so on up to 300.<end_of_turn>\n<start_of_turn>user\nNow count down from 5.<end_of_turn>\n"
                "<start_of_turn>model\n<think>\n")
        assert line["prefilled"] == count(rest) == second["usage"]["input_tokens"] - line["reused"], line
    finally:
        srv.stop()
