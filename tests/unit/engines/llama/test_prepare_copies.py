"""Preparing writes nothing it was given: the billing-header repair,
truncation, opened sealed reasoning and a remembered turn's history each
make a new conversation (the prepared form holds the last), and the run
context (owner, session, agent) reaches the cache request as given."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Conversation, Message, Reasoning
from lmspd.core.run import RunContext
from lmspd.core.sealing import Sealer
from support.grammar_rig import vocab_only_preparation

BILLING = "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli; cch=0a1b2;\n"


@pytest.fixture(scope="module")
def preparation():
    return vocab_only_preparation()


def long_conversation(instructions: str | None = None) -> Conversation:
    items = [Message("system", BILLING + "You are terse.")] if instructions is None else []
    for i in range(100):
        items += [Message("user", f"Question {i}: " + "lorem ipsum dolor " * 8), Message("assistant", f"Answer {i}.")]
    items.append(Message("user", "The last question."))
    return Conversation(model="m", items=items, instructions=instructions, max_output_tokens=64, truncate=True)


@pytest.mark.parametrize("instructions", [None, BILLING + "You are terse."])
def test_repairs_and_truncation_leave_the_given_conversation_as_it_was(preparation, instructions):
    conversation = long_conversation(instructions)
    items = conversation.items
    run = RunContext(owner="key_alice", session_key="sess", agent_id="agent-2", parent_agent_id="agent-1")
    prepared = preparation.prepare(conversation, run)
    assert conversation == long_conversation(instructions) and conversation.items is items
    assert len(items) == (202 if instructions is None else 201)
    assert (conversation.instructions or items[0].text).startswith(BILLING)
    done = prepared.conversation
    assert done is not conversation and len(done.items) < len(items), "truncated, in a copy"
    assert "x-anthropic-billing-header" not in prepared.text
    assert (done.instructions or done.items[0].text) == "You are terse."
    assert prepared.run is run
    request = prepared.cache_request()
    assert (request.owner, request.agent, request.parent_agent, request.pin) == ("key_alice", "agent-2", "agent-1",
                                                                                None)


def test_a_conversation_prepare_does_not_change_is_the_one_it_holds(preparation):
    conversation = Conversation(model="m", items=[Message("user", "Hi.")])
    assert preparation.prepare(conversation).conversation is conversation


def test_opened_reasoning_is_a_copy(preparation, monkeypatch, tmp_path):
    sealer = Sealer.from_data_dir(tmp_path)
    monkeypatch.setattr(preparation, "sealer", sealer)
    monkeypatch.setattr(preparation, "reasoning", object())  # a model that renders hidden reasoning
    sealed = Reasoning(summary=["Thought."], encrypted_content=sealer.seal("m", "the hidden text", owner="key_alice"))
    conversation = Conversation(model="m", items=[Message("user", "Hi."), sealed, Message("assistant", "Hello.")])
    opened = preparation._open_sealed_reasoning(conversation, "key_alice")
    assert sealed.hidden is None and conversation.items[1] is sealed
    assert opened.items[1].hidden == "the hidden text" and opened.items[0] is conversation.items[0]


def test_reasoning_sealed_for_another_model_renders_without_it(preparation, monkeypatch, tmp_path):
    """A client that switched models mid-conversation replays the first
    model's sealed reasoning to the second: the turn renders as a visible-only
    replay (it was a 400 on every later turn). Another key's blob is still
    refused."""
    from lmspd.core.errors import ApiError

    sealer = Sealer.from_data_dir(tmp_path)
    monkeypatch.setattr(preparation, "sealer", sealer)
    monkeypatch.setattr(preparation, "reasoning", object())
    assert preparation.model_id != "another-model"
    sealed = Reasoning(summary=["Thought."],
                       encrypted_content=sealer.seal("another-model", "its hidden text", owner="key_alice"))
    conversation = Conversation(model="m", items=[Message("user", "Hi."), sealed, Message("assistant", "Hello.")])
    assert preparation._open_sealed_reasoning(conversation, "key_alice") is conversation
    assert sealed.hidden is None
    with pytest.raises(ApiError) as info:
        preparation._open_sealed_reasoning(conversation, "key_bob")
    assert info.value.status == 400 and info.value.param == "input[1].encrypted_content"


def test_the_billing_repair_moves_the_breakpoints_with_the_text(preparation):
    """Claude Code marks its system prompt's end with cache_control; the
    billing line the repair removes from its start left that breakpoint's
    offset pointing past the end of the shorter text (on a non-trimmable KV
    the exact state was kept at the wrong place, or nowhere)."""
    text = BILLING + "You are terse. Be kind."
    marks = (len(BILLING) - 3, len(BILLING) + 14, len(text))  # one inside the removed line
    conv = Conversation(model="m", items=[Message("system", text, breakpoints=marks), Message("user", "Hi.")])
    first = preparation._repair(conv).items[0]
    assert first.text == "You are terse. Be kind."
    assert [first.text[:at] for at in first.breakpoints] == ["You are terse.", "You are terse. Be kind."]
    conv = Conversation(model="m", items=[Message("user", "Hi.")], instructions=text,
                        instructions_breakpoints=marks[1:])
    repaired = preparation._repair(conv)
    assert [repaired.instructions[:at] for at in repaired.instructions_breakpoints] == [
        "You are terse.", "You are terse. Be kind."]
