"""The compaction item: sealing, expansion, what it stands for; and the
WebSocket frame parser never failing but with an ApiError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.bodies import parse_json_object
from lmspd.core import compaction
from lmspd.core.conversation import Message, ToolCall, ToolOutput
from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.core.sealing import Sealer
from support.sealed import assert_unreadable

SEALER = Sealer(b"k" * 32)


def test_seal_and_expand_round_trip():
    blob = compaction.seal(SEALER, "Ada goes to Oslo.")
    msg = compaction.expand(SEALER, blob, "input[3]", "cmp_1")
    assert msg.role == "user" and msg.text.endswith("Ada goes to Oslo.") and msg.compaction == blob
    assert msg.id == "cmp_1"
    assert_unreadable(blob, "Ada goes to Oslo.")


@pytest.mark.parametrize("mutate", [lambda b: b[:10] + ("x" if b[10] != "x" else "y") + b[11:],
                                    lambda b: b[:-4], lambda b: "garbage", lambda b: ""])
def test_tampered_blob_is_a_400_naming_it(mutate):
    blob = compaction.seal(SEALER, "summary")
    with pytest.raises(ApiError) as info:
        compaction.expand(SEALER, mutate(blob), "input[0]")
    assert info.value.status == 400 and info.value.param == "input[0].encrypted_content"


def test_other_keys_and_other_purposes_do_not_open():
    blob = compaction.seal(SEALER, "summary")
    with pytest.raises(ApiError):
        compaction.expand(Sealer(b"z" * 32), blob, "input[0]")
    reasoning = SEALER.seal("m", "hidden thoughts")
    with pytest.raises(ApiError):
        compaction.expand(SEALER, reasoning, "input[0]")
    with pytest.raises(ApiError):
        SEALER.open("m", blob, "input[0].encrypted_content")


def test_a_compaction_stands_for_the_assistant_and_tool_turns_before_it():
    dev = Message(role="developer", text="rules")
    user = Message(role="user", text="task")
    call = ToolCall(call_id="c1", name="ls", payload="{}")
    out = ToolOutput(call_id="c1", output="a b")
    said = Message(role="assistant", text="done")
    comp = compaction.summary_message("s", "blob", "cmp_1")
    new = Message(role="user", text="next")
    assert compaction.effective_items([dev, user, call, out, said, comp, new]) == [dev, user, comp, new]
    assert compaction.effective_items([user, call, out]) == [user, call, out]
    # Only the last compaction counts; an older one is part of what it stands for.
    older = compaction.summary_message("old", "blob0", "cmp_0")
    assert compaction.effective_items([older, said, user, comp]) == [user, comp]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30).map(lambda v: __import__("json").dumps(v))))
def test_frame_parser_only_ever_raises_api_errors(text):
    limits = RequestLimits(max_body_bytes=150, max_json_depth=5)
    try:
        value = parse_json_object(text, limits)
    except ApiError as exc:
        assert exc.status in (400, 413)
        return
    assert isinstance(value, dict)


def test_another_owners_blob_does_not_open():
    blob = compaction.seal(SEALER, "summary", owner="alice")
    assert compaction.expand(SEALER, blob, "input[0]", owner="alice").text.endswith("summary")
    with pytest.raises(ApiError) as info:
        compaction.expand(SEALER, blob, "input[0]", owner="bob")
    assert info.value.status == 400 and info.value.param == "input[0].encrypted_content"
