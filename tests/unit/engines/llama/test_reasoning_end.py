"""Where a generation's reasoning section ends, for the exact-state
checkpoint a non-trimmable KV keeps there (``Generation.take_reasoning_end``):
the KV's token count at the last token boundary that holds hidden text only,
and the sampled text past the prompt those tokens hold. Driven token by
token as the scheduler does, over a toy vocabulary whose tokens are whole
strings (tests/support/generation_rig.py)."""

from __future__ import annotations

from types import SimpleNamespace

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.engines.llama.generation import Generation
from lmspd.engines.llama.preparation import LlamaPrepared
from lmspd.engines.llama.reasoning import BUDGETS, ReasoningSyntax
from support.generation_rig import EOG, PROMPT, ToyVocab, toy_generation


def generation(vocab: ToyVocab, *, effort: str | None = "high", stop: list[str] | None = None,
               markers: list[str] | None = None, include: bool = True, sealer: bool = True) -> Generation:
    """``include``: the request asks for the sealed reasoning; ``sealer``: the
    server can seal it. Both are needed for a replay to render it again.
    ``stop``: the client's stop sequences; ``markers``: those the engine adds
    (a tool result's marker)."""
    conv = Conversation(model="m", items=[Message("user", "q")], sampling=Sampling(stop=stop or []),
                        reasoning_effort=effort, include_encrypted_reasoning=include)
    prepared = LlamaPrepared(conversation=conv, text="PROMPT<think>\n", tokens=list(PROMPT), max_new_tokens=64,
                             stop=(stop or []) + (markers or []))
    return toy_generation(vocab, prepared, reasoning=ReasoningSyntax("<think>", "</think>", "<think>\n"),
                          sealer=SimpleNamespace(seal=lambda model, hidden, owner: "sealed") if sealer else None)


def drive(gen: Generation, vocab: ToyVocab, pieces: list[str]) -> list[tuple[int, str]]:
    """Sample ``pieces`` in order (forced tokens first where the budget is
    spent); every reasoning end taken, as the scheduler takes it."""
    ends = []
    for text in pieces:
        forced = gen.before_sample()
        gen.kv_tokens.extend(forced)
        if gen.done:
            break
        pending = gen.on_token(vocab.id(text) if text else EOG)
        end = gen.take_reasoning_end()
        if end is not None:
            # The scheduler checkpoints here: the KV is exactly ``end[0]`` tokens.
            assert len(gen.kv_tokens) == end[0]
            ends.append(end)
        gen.kv_tokens.extend(pending)
        if gen.done:
            break
    return ends


def test_the_end_is_the_token_boundary_before_the_first_visible_text():
    vocab = ToyVocab()
    gen = generation(vocab)
    ends = drive(gen, vocab, ["Hmm", " fine", "</think>", "\n\n", "Hello", " there", ""])
    assert ends == [(len(PROMPT) + 4, "Hmm fine</think>\n\n")]
    assert gen.splitter is not None and gen.splitter.hidden == "<think>\nHmm fine</think>\n\n"


def test_a_token_that_closes_the_block_and_starts_the_answer_ends_before_it():
    """No boundary lies at the close itself: the last one before it holds
    hidden text only (a replay restores there and prefills the close too)."""
    vocab = ToyVocab()
    ends = drive(generation(vocab), vocab, ["Hmm", "</think>\n\nHello", ""])
    assert ends == [(len(PROMPT) + 1, "Hmm")]


def test_a_close_lmspd_forces_is_in_the_kv_before_the_end():
    vocab = ToyVocab()
    budget = BUDGETS["minimal"]
    gen = generation(vocab, effort="minimal")
    ends = drive(gen, vocab, ["x"] * budget + ["Hello", ""])
    forced = ReasoningSyntax("<think>", "</think>", "<think>\n").forced_close
    assert ends == [(len(PROMPT) + budget + len(forced), "x" * budget + forced)]
    assert gen.usage.reasoning_tokens == budget


def test_no_end_when_the_kv_already_holds_visible_text():
    """A marker the engine stops at held the answer's first piece back: by
    the time the text shows, the KV holds it too, so no prefix of the KV is
    hidden text only past the last boundary the splitter saw."""
    vocab = ToyVocab()
    gen = generation(vocab, markers=["<tool_response"])
    assert drive(gen, vocab, ["Hmm", "</think>", "<tool", "_x", " there", ""]) == []


def test_a_client_stop_holds_the_answer_back_after_the_splitter():
    """The client's stop sequences are matched on the answer alone, after
    the splitter: the answer's first piece held back as a stop's start no
    longer hides where the reasoning ended."""
    vocab = ToyVocab()
    ends = drive(generation(vocab, stop=["Hello!"]), vocab, ["Hmm", "</think>", "Hel", "lo", " there", ""])
    assert ends == [(len(PROMPT) + 2, "Hmm</think>")]


def test_no_end_when_nothing_was_sampled_in_the_block():
    """Effort none: lmspd closes the block before the first sample; the end
    of the input is a checkpoint already, a few forced tokens before."""
    vocab = ToyVocab()
    gen = generation(vocab, effort="none")
    assert drive(gen, vocab, ["Hello", ""]) == []


def test_a_turn_that_ends_right_after_its_reasoning_ends_there():
    vocab = ToyVocab()
    ends = drive(generation(vocab), vocab, ["Hmm", "</think>", ""])
    assert ends == [(len(PROMPT) + 2, "Hmm</think>")]


def test_the_end_is_taken_once():
    vocab = ToyVocab()
    gen = generation(vocab)
    drive(gen, vocab, ["Hmm", "</think>", "Hello"])
    assert gen.take_reasoning_end() is None


def test_no_end_when_no_replay_can_render_the_reasoning():
    """Only sealed reasoning is rendered in a replay (``prompt.py``): without
    ``include`` of it, or with no sealer on the server, no request can
    resume at the end of this reasoning, so none is taken (each one
    costs the scheduler a KV capture)."""
    for include, sealer in ((False, True), (True, False)):
        vocab = ToyVocab()
        gen = generation(vocab, include=include, sealer=sealer)
        assert drive(gen, vocab, ["Hmm", " fine", "</think>", "\n\n", "Hello", ""]) == [], (include, sealer)


def test_reasoning_held_as_a_stops_start_stays_reasoning_when_the_budget_closes_it():
    """A reasoning token ending in a stop's first characters (``<`` of
    ``<tool_response``, a stop lmspd adds where tools are offered) is held
    back; the close the budget forces went to the splitter first, and the
    held ``<`` came out after it, as visible text."""
    from lmspd.core.events import ReasoningDelta, TextDelta

    vocab = ToyVocab()
    budget = BUDGETS["minimal"]
    events: list = []
    conv = Conversation(model="m", items=[Message("user", "q")], reasoning_effort="minimal",
                        include_encrypted_reasoning=True)
    prepared = LlamaPrepared(conversation=conv, text="PROMPT<think>\n", tokens=list(PROMPT), max_new_tokens=64,
                             stop=["<tool_response"])
    gen = toy_generation(vocab, prepared, reasoning=ReasoningSyntax("<think>", "</think>", "<think>\n"),
                         sealer=SimpleNamespace(seal=lambda model, hidden, owner: "sealed"), on_event=events.append)
    drive(gen, vocab, ["x"] * (budget - 1) + ["a <"] + ["Hello", ""])
    visible = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert "<" not in visible and visible.endswith("Hello")
    assert reasoning.rstrip("\n").endswith("a <")


def _run(gen: Generation, vocab: ToyVocab, pieces: list[str], events: list) -> tuple[str, str, object]:
    from lmspd.core.events import Finished, ReasoningDelta, TextDelta

    drive(gen, vocab, pieces)
    visible = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    (finished,) = [e for e in events if isinstance(e, Finished)]
    return reasoning, visible, finished


def _with_events(*, stop: list[str], markers: list[str] = (), syntax: bool = True,
                 tool_format=None) -> tuple[Generation, ToyVocab, list]:
    vocab, events = ToyVocab(), []
    conv = Conversation(model="m", items=[Message("user", "q")], sampling=Sampling(stop=stop))
    prepared = LlamaPrepared(conversation=conv, text="PROMPT<think>\n", tokens=list(PROMPT), max_new_tokens=64,
                             stop=stop + list(markers))
    gen = toy_generation(vocab, prepared, on_event=events.append, tool_format=tool_format,
                         reasoning=ReasoningSyntax("<think>", "</think>", "<think>\n") if syntax else None)
    return gen, vocab, events


def test_a_client_stop_sequence_inside_the_reasoning_stays_dormant():
    """A model restating "Question:" while it thinks: the client's stop ends
    the answer, not the reasoning before it (it ended the turn with no
    answer at all)."""
    gen, vocab, events = _with_events(stop=["Question:"])
    reasoning, visible, finished = _run(gen, vocab, ["The", " Question", ":", " is", " easy", "</think>", "Sure", ".",
                                                     " Question", ":", " more", ""], events)
    assert reasoning.startswith("The Question: is easy")
    assert visible == "Sure. "
    assert (finished.reason, finished.stop_sequence) == ("stop", "Question:")
    assert gen.done and gen.usage.output_tokens == 10  # the turn ended at the stop, in the answer


def test_a_marker_the_engine_stops_at_still_ends_the_turn_inside_the_reasoning():
    gen, vocab, events = _with_events(stop=["Question:"], markers=["<tool_response"])
    reasoning, visible, finished = _run(gen, vocab, ["Hmm", " <tool_response", ">", " x", ""], events)
    assert reasoning.startswith("Hmm") and "<tool_response" not in reasoning and visible == ""
    assert (finished.reason, finished.stop_sequence) == ("stop", None)


def test_an_answer_held_back_as_a_stops_start_comes_out_at_the_end():
    gen, vocab, events = _with_events(stop=["Hello!"])
    _, visible, finished = _run(gen, vocab, ["Hmm", "</think>", "Well", " Hel", ""], events)
    assert visible == "Well Hel" and (finished.reason, finished.stop_sequence) == ("stop", None)


def test_without_a_reasoning_syntax_the_client_stop_applies_to_all_text():
    gen, vocab, events = _with_events(stop=["Question:"], syntax=False)
    _, visible, finished = _run(gen, vocab, ["The", " Question", ":", " more", ""], events)
    assert visible == "The " and (finished.reason, finished.stop_sequence) == ("stop", "Question:")


def test_a_call_where_none_may_be_made_ends_the_answer_not_the_reasoning():
    """tool_choice none: the call's opening is a stop (preparation), so that
    no call markup reaches the text. Thinking about a call is not making
    one: in the reasoning it stays dormant, in the answer it ends the turn."""
    from lmspd.engines.llama.tool_formats import HermesFormat

    fmt = HermesFormat(True)
    gen, vocab, events = _with_events(stop=[], markers=[*fmt.result_markers, fmt.trigger], tool_format=fmt)
    reasoning, visible, finished = _run(gen, vocab, ["I", " could", " write", " <tool_call>", " but", " no", "</think>",
                                                     "Here", " <tool_call>", "{", ""], events)
    assert "I could write <tool_call> but no" in reasoning
    assert visible == "Here " and (finished.reason, finished.stop_sequence) == ("stop", None)
    # A tool result's marker still ends the turn inside the reasoning.
    gen, vocab, events = _with_events(stop=[], markers=[*fmt.result_markers, fmt.trigger], tool_format=fmt)
    reasoning, visible, finished = _run(gen, vocab, ["Hmm", " <tool_response>", " x", ""], events)
    assert "<tool_response" not in reasoning and visible == "" and finished.reason == "stop"
