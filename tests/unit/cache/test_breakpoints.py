"""Client-declared cache breakpoints: decoded from both dialects into
offsets of the neutral text, located as token positions in a rendered
prompt, and planned as exact-state checkpoints on a non-trimmable KV (the
prefill stops there; a request diverging after one resumes from it)."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.dialects import anthropic_messages, openai_responses
from lmspd.engines.llama.breakpoints import token_positions
from support.cache_rig import INSTRUCTIONS, make_cache, request

LIMITS = RequestLimits()
MARK = {"mode": "explicit"}


def responses(content):
    body = {"model": "m", "input": [{"type": "message", "role": "developer", "content": content},
                                    {"role": "user", "content": "q"}]}
    return openai_responses.decode_request(body, LIMITS).conversation


def test_responses_breakpoint_is_the_end_of_its_part():
    conv = responses([{"type": "input_text", "text": "Rules. ", "prompt_cache_breakpoint": MARK},
                      {"type": "input_text", "text": "Today is Monday."}])
    msg = conv.items[0]
    assert msg.text == "Rules. Today is Monday." and msg.breakpoints == (len("Rules. "),)
    assert conv.items[1].breakpoints == ()


@pytest.mark.parametrize("marker", [{"mode": "implicit"}, "explicit", {"mode": "explicit", "ttl": 5}])
def test_responses_breakpoint_of_another_shape_is_refused(marker):
    with pytest.raises(ApiError) as exc:
        responses([{"type": "input_text", "text": "x", "prompt_cache_breakpoint": marker}])
    assert exc.value.param == "input[0].content[0].prompt_cache_breakpoint"


def test_more_breakpoints_than_the_limit_are_refused():
    with pytest.raises(ApiError, match="cache breakpoints; the limit is 4"):
        responses([{"type": "input_text", "text": f"p{i}", "prompt_cache_breakpoint": MARK} for i in range(5)])


def test_anthropic_cache_control_on_system_and_text_blocks():
    body = {"model": "m", "max_tokens": 4,
            "system": [{"type": "text", "text": "You are terse."},
                       {"type": "text", "text": "Rules.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Date: today."}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "A long file.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "What is in it?"}]}]}
    conv = anthropic_messages.decode_request(body, LIMITS).conversation
    assert conv.instructions[:conv.instructions_breakpoints[0]] == "You are terse.\n\nRules."
    msg = conv.items[0]
    assert msg.text[:msg.breakpoints[0]] == "A long file."


def test_breakpoint_positions_in_a_rendered_prompt(vocab):
    cache = make_cache(vocab)
    tok = cache.ops.tokenize
    notes = "Notes: the otter crossed river 7. The heron did not.   "  # a template may trim the trailing spaces
    conv = Conversation(model="m", items=[Message("system", notes, breakpoints=(len(notes),)),
                                          Message("user", "Which animal?")])
    text = f"<|im_start|>system\n{notes.strip()}<|im_end|>\n<|im_start|>user\nWhich animal?<|im_end|>\n"
    tokens = tok(text)
    (pos,) = token_positions(conv, text, tokens, tok)
    assert tokens[:pos] == tok(f"<|im_start|>system\n{notes.strip()}")
    # Text the prompt does not contain locates nothing.
    missing = Conversation(model="m", items=[Message("user", "elsewhere", breakpoints=(9,))])
    assert token_positions(missing, text, tokens, tok) == ()


def test_a_non_trimmable_prefill_stops_at_a_breakpoint_and_a_divergence_after_it_resumes_there(vocab):
    cache = make_cache(vocab, n_seq=2, floors={0: 10**6, 1: 10**6})
    head = INSTRUCTIONS
    first = request(cache, head + "<|im_start|>user\nFirst question<|im_end|>\n",
                    breakpoints=(len(cache.ops.tokenize(head)),))
    plan = cache.apply(cache.plan(first), first)
    assert cache.breakpoints_ahead(first, plan.seq) == list(first.breakpoints)
    r = cache.residents[plan.seq]
    r.tokens.extend(plan.suffix[: first.breakpoints[0]])  # the prefill reached the breakpoint
    cache.checkpoint(plan.seq, "local", "breakpoint")
    assert cache.breakpoints_ahead(first, plan.seq) == [], "reached"
    r.tokens.extend(plan.suffix[first.breakpoints[0]:])
    # A request with the same breakpoint on another sequence: already checkpointed, no stop needed.
    assert cache.breakpoints_ahead(first, 1 - plan.seq) == []
    other = request(cache, head + "<|im_start|>user\nA different question<|im_end|>\n")
    resume = cache.plan(other)
    assert resume.source == "checkpoint" and resume.detail.startswith("at=breakpoint from=ram"), resume
    assert resume.keep == first.breakpoints[0]


def test_a_trimmable_kv_takes_no_breakpoint_checkpoints(vocab):
    cache = make_cache(vocab)
    req = request(cache, INSTRUCTIONS + "<|im_start|>user\nq<|im_end|>\n", breakpoints=(5,))
    assert cache.breakpoints_ahead(req, 0) == []


def test_implicit_breakpoints_end_the_instructions_and_the_leading_developer_messages(vocab):
    tok = make_cache(vocab).ops.tokenize
    rules = "You are a coding agent. Follow the repository's conventions."
    env = "The working directory is /src. The shell is bash."
    conv = Conversation(model="m", instructions=rules,
                        items=[Message("developer", env), Message("user", "Fix the bug."),
                               Message("developer", "Later notes are not a shared prefix.")])
    text = (f"<|im_start|>system\n{rules}\n\n{env}<|im_end|>\n<|im_start|>user\nFix the bug.<|im_end|>\n"
            "<|im_start|>system\nLater notes are not a shared prefix.<|im_end|>\n")
    tokens = tok(text)
    # Declared only: none here.
    assert token_positions(conv, text, tokens, tok) == ()
    ends = token_positions(conv, text, tokens, tok, implicit=True)
    assert [tokens[:p] for p in ends] == [tok(f"<|im_start|>system\n{rules}"),
                                          tok(f"<|im_start|>system\n{rules}\n\n{env}")]


def test_anthropic_cache_control_on_a_tool_result_and_on_its_text():
    body = {"model": "m", "max_tokens": 4,
            "tools": [{"name": "ls", "input_schema": {"type": "object"}},
                      {"name": "cat", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "List it."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}},
                                                  {"type": "tool_use", "id": "t2", "name": "ls", "input": {}},
                                                  {"type": "tool_use", "id": "t3", "name": "ls", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt b.txt",
                     "cache_control": {"type": "ephemeral"}},
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True, "cache_control": {"type": "ephemeral"},
                     "content": [{"type": "text", "text": "denied", "cache_control": {"type": "ephemeral"}},
                                 {"type": "text", "text": "retry later"}]},
                    {"type": "tool_result", "tool_use_id": "t3", "content": "unmarked"}]}]}
    conv = anthropic_messages.decode_request(body, LIMITS).conversation
    assert conv.tools_breakpoint
    first, second, third = conv.items[-3:]
    assert first.output[:first.breakpoints[0]] == "a.txt b.txt" and len(first.breakpoints) == 1
    # Offsets follow the "Error: " the neutral output spells the flag with.
    assert [second.output[:at] for at in second.breakpoints] == ["Error: denied", "Error: denied\n\nretry later"]
    assert third.breakpoints == ()
    body["tools"][1].pop("cache_control")
    assert not anthropic_messages.decode_request(body, LIMITS).conversation.tools_breakpoint


def test_responses_breakpoint_on_a_function_call_output_part():
    body = {"model": "m", "input": [
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "a.txt b.txt", "prompt_cache_breakpoint": MARK},
                    {"type": "input_text", "text": " (2 files)"}]}],
        "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}]}
    out = openai_responses.decode_request(body, LIMITS).conversation.items[1]
    assert out.output == "a.txt b.txt (2 files)" and out.breakpoints == (len("a.txt b.txt"),)


def test_a_tool_output_breakpoint_and_the_end_of_the_tools_are_positions(vocab):
    from lmspd.core.conversation import ToolCall, ToolOutput

    tok = make_cache(vocab).ops.tokenize
    tools_block = "# Tools\n## ls\nLists a directory."
    result = "a.txt b.txt c.txt d.txt"
    conv = Conversation(model="m", items=[Message("user", "List it."), ToolCall("c1", "ls", "{}"),
                                          ToolOutput("c1", result, breakpoints=(len(result),)),
                                          Message("user", "Which is newest?")])
    text = (f"<|im_start|>system\n{tools_block}<|im_end|>\n<|im_start|>user\nList it.<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>{"name": "ls"}</tool_call><|im_end|>\n'
            f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>user\nWhich is newest?<|im_end|>\n")
    tokens = tok(text)
    (at_result,) = token_positions(conv, text, tokens, tok)
    assert tok(text)[:at_result] == tok(text[:text.index(result) + len(result)])
    tools_end = text.index("<|im_start|>user")
    ends = token_positions(conv, text, tokens, tok, tools_end=tools_end)
    assert ends == (len(tok(text[:tools_end])), at_result)


def test_the_end_of_the_tools_is_where_the_rendered_tool_definitions_end():
    from lmspd.core.conversation import FunctionTool
    from support.grammar_rig import vocab_only_preparation

    prep = vocab_only_preparation()
    tools = [FunctionTool(name="ls", description="Lists a directory.", parameters={"type": "object"})]
    conv = Conversation(model="m", instructions="Be terse.", tools=tools, tools_breakpoint=True,
                        items=[Message("developer", "Repository rules."), Message("user", "List it.")])
    text = prep.render(conv)
    end = prep._tools_end(conv, text)
    assert end is not None
    # The tool block, and the header of the turn that always follows it.
    assert text[:end].endswith(prep.tool_format.system_block(tools) + "<|im_end|>\n<|im_start|>user\n")
    assert text[end:].startswith("List it.")
    assert prep._tools_end(Conversation(model="m", items=conv.items, tools=tools), text) is None  # not declared


def test_the_item_before_a_closing_user_message_ends_at_an_implicit_breakpoint(vocab):
    """Where an edit of the closing user message (a branch) diverges."""
    from lmspd.core.conversation import ToolCall, ToolOutput

    tok = make_cache(vocab).ops.tokenize
    result = "a.txt b.txt c.txt d.txt"
    conv = Conversation(model="m", items=[Message("user", "List it."), ToolCall("c1", "ls", "{}"),
                                          ToolOutput("c1", result), Message("user", "Which is newest?")])
    text = ('<|im_start|>user\nList it.<|im_end|>\n<|im_start|>assistant\n<tool_call>{"name": "ls"}</tool_call>'
            f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>user\nWhich is newest?<|im_end|>\n")
    tokens = tok(text)
    assert token_positions(conv, text, tokens, tok) == ()  # declared only: none
    (pos,) = token_positions(conv, text, tokens, tok, implicit=True)
    assert tokens[:pos] == tok(text[:text.index(result) + len(result)])
    chat = Conversation(model="m", items=[Message("user", "Hi."), Message("assistant", "Hello, how can I help?"),
                                          Message("user", "Name a colour.")])
    text = ("<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\nHello, how can I help?<|im_end|>\n"
            "<|im_start|>user\nName a colour.<|im_end|>\n")
    tokens = tok(text)
    (pos,) = token_positions(chat, text, tokens, tok, implicit=True)
    assert tokens[:pos] == tok(text[:text.index("help?") + 5])
    # Not when the conversation does not end with a user message.
    assert token_positions(Conversation(model="m", items=chat.items[:2]), text, tokens, tok, implicit=True) == ()


def test_a_checkpoint_taken_after_a_sampled_turn_is_found_by_its_visible_transcript(vocab):
    """The KV holds the model's own spelling of its turn (a call's JSON as
    sampled, ``{"x":1}``; the client replays ``{"x": 1}``): a checkpoint
    taken while a later prefill continues it matches a branch neither by
    tokens nor by the KV's text, only by the request text its KV covers."""
    from lmspd.cache.state import SessionState
    from support.cache_rig import hold

    cache = make_cache(vocab, n_seq=2, floors={0: 10**6, 1: 10**6})
    tok = cache.ops.tokenize
    prompt = INSTRUCTIONS + "<|im_start|>user\nCall it<|im_end|>\n<|im_start|>assistant\n"
    sampled = tok(prompt + '{"x":1}')
    visible = prompt + '{"x": 1}<|im_end|>\n'
    hold(cache, 0, SessionState(tokens=sampled, kv_text=prompt + '{"x":1}', visible=visible))
    result = "<|im_start|>user\n<tool_response>\n" + "a.txt b.txt " * 20 + "\n</tool_response><|im_end|>\n"
    follow = request(cache, visible + result + "<|im_start|>user\nWhich is newest?<|im_end|>\n")
    plan = cache.apply(cache.plan(follow), follow)
    assert plan.source == "visible-prefix" and plan.seq == 0
    r = cache.residents[0]
    upto = len(tok(result))  # the breakpoint: the end of the tool result
    assert plan.suffix[:upto] == tok(result)
    r.tokens.extend(plan.suffix[:upto])
    cache.checkpoint(0, "local", "breakpoint")
    r.tokens.extend(plan.suffix[upto:])
    cache.finished(0, SessionState(tokens=list(r.tokens), kv_text=cache.ops.detokenize(r.tokens), visible=None))
    cache.release(0)
    branch = request(cache, visible + result + "<|im_start|>user\nWhich is oldest?<|im_end|>\n")
    resume = cache.plan(branch)
    assert resume.source == "checkpoint" and resume.detail.startswith("at=breakpoint from=ram"), resume
    assert resume.keep == len(sampled) + upto  # the turn as sampled, then the result
    assert resume.suffix == tok("<|im_start|>user\nWhich is oldest?<|im_end|>\n")
