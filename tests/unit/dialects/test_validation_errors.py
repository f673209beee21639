"""A pydantic error becomes an error that names the client's parameter, never
the union member pydantic tried (``input.str``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lmspd.dialects.anthropic_messages import CreateMessage
from lmspd.dialects.chat_completions import ChatCompletionRequest
from lmspd.dialects.lmsp import LmspCreateResponse
from lmspd.dialects.openai_responses import CreateResponse
from lmspd.dialects.responses_items import validation_error

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def error_of(model, body, prefix=""):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value, prefix)


@pytest.mark.parametrize("model,body,param,message", [
    (LmspCreateResponse, {"model": "m", "input": None}, "input",
     "Invalid type for 'input': expected one of a string or an array, but got null instead."),
    (CreateResponse, {"model": "m", "input": {"role": "user"}}, "input",
     "Invalid type for 'input': expected one of a string or an array, but got an object instead."),
    (CreateResponse, {"model": "m", "tool_choice": 5}, "tool_choice",
     "Invalid type for 'tool_choice': expected one of a string or an object, but got an integer instead."),
    (ChatCompletionRequest, {**CHAT, "stop": 3}, "stop",
     "Invalid type for 'stop': expected one of a string or an array, but got an integer instead."),
    (CreateMessage, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "system": 7}, "system",
     "Invalid type for 'system': expected one of a string or an array, but got an integer instead."),
])
def test_a_value_no_member_of_a_union_takes_lists_what_the_parameter_accepts(model, body, param, message):
    err = error_of(model, body)
    assert (err.code, err.param, err.message) == ("invalid_request", param, message)


def test_the_member_a_value_matched_names_the_part_that_is_wrong():
    """``stop: ["a", 1]`` is an array: the array's item is the error, not "not a string"."""
    err = error_of(ChatCompletionRequest, {**CHAT, "stop": ["a", 1]})
    assert err.param == "stop[1]" and "valid string" in err.message


def test_a_key_that_looks_like_a_type_name_is_still_named():
    err = error_of(CreateResponse, {"model": "m", "metadata": {"str": 1}})
    assert err.param == "metadata.str"
    err = error_of(CreateResponse, {"model": "m", "metadata": {"str": 1, "list": 2}})
    assert err.param == "metadata.str" and "valid string" in err.message


def test_a_prefix_leads_the_parameter():
    err = error_of(LmspCreateResponse, {"model": "m", "input": 4}, prefix="body")
    assert err.param == "body.input"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
FIELDS = st.sampled_from(["model", "input", "tool_choice", "tools", "stop", "system", "messages", "metadata",
                          "max_tokens", "max_output_tokens", "text", "reasoning", "include", "str"])


@settings(max_examples=300, deadline=None)
@given(model=st.sampled_from([LmspCreateResponse, CreateResponse, ChatCompletionRequest, CreateMessage]),
       body=st.dictionaries(FIELDS, JSON, max_size=4))
def test_every_validation_error_becomes_a_client_error_naming_a_parameter(model, body):
    body.setdefault("model", "m")  # else its absence is the first error, every time
    try:
        model.model_validate(body)
    except ValidationError as exc:
        err = validation_error(exc)
        assert err.status == 400 and err.param is not None
        assert "[any]" not in err.param and "[str" not in err.param
        if "metadata" not in body:  # only a metadata key may be named "str"
            assert not {"str", "list", "dict"} & set(err.param.split(".")[1:]), err.param


def test_a_member_whose_type_the_value_has_reports_its_constraint():
    from typing import Annotated, Union

    from pydantic import BaseModel, Field

    class Body(BaseModel):
        x: Union[Annotated[str, Field(max_length=3)], list[str]] = "a"  # noqa: UP007 - the union pydantic names

    err = error_of(Body, {"x": "too long"})
    assert err.param == "x" and "at most 3 characters" in err.message


LMSP = {"model": "m", "input": "hi"}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model,body,field", [
    (model, {**base, field: value}, field)
    for model, base, fields in (
        (LmspCreateResponse, LMSP, ("stream", "store", "max_output_tokens", "temperature")),
        (CreateResponse, LMSP, ("stream", "store", "background", "max_output_tokens", "temperature")),
        (ChatCompletionRequest, CHAT, ("stream", "max_tokens", "temperature")),
        (CreateMessage, MESSAGES, ("stream", "max_tokens", "temperature")),
    )
    for field in fields
    for value in ({"stream": "yes", "store": "true", "background": 1, "max_output_tokens": True,
                   "max_tokens": "8", "temperature": "0.5"}[field],)
])
def test_a_value_of_another_json_type_is_refused_not_coerced(model, body, field):
    """``"stream": "yes"`` was a stream and ``"max_output_tokens": true`` a
    one-token reply: pydantic's lax mode coerces them. A 400 naming the
    field, as OpenAI answers."""
    err = error_of(model, body)
    assert (err.code, err.param) == ("invalid_request", field), err.message


@pytest.mark.parametrize("model,body", [
    (LmspCreateResponse, {**LMSP, "temperature": 1, "top_p": 1}),
    (CreateResponse, {**LMSP, "temperature": 0, "top_p": 1}),
    (ChatCompletionRequest, {**CHAT, "temperature": 1, "presence_penalty": 0}),
    (CreateMessage, {**MESSAGES, "temperature": 1}),
])
def test_an_integer_is_still_a_number(model, body):
    assert model.model_validate(body).temperature == body["temperature"]


MANY = 50_000
NUMBERS = list(range(MANY))
NUMBER_VALUES = {f"k{i}": i for i in range(MANY)}
MESSAGES = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model,body,param", [
    (CreateResponse, {"model": "m", "metadata": NUMBER_VALUES}, "metadata"),
    (CreateResponse, {"model": "m", "include": NUMBERS}, "include"),
    (ChatCompletionRequest, {**CHAT, "metadata": NUMBER_VALUES}, "metadata"),
    (ChatCompletionRequest, {**CHAT, "stop": NUMBERS}, "stop"),
    (ChatCompletionRequest, {**CHAT, "modalities": NUMBERS}, "modalities"),
    (ChatCompletionRequest, {**CHAT, "logit_bias": {f"k{i}": "x" for i in range(MANY)}}, "logit_bias"),
    (CreateMessage, {**MESSAGES, "stop_sequences": NUMBERS}, "stop_sequences"),
])
def test_a_collection_of_bad_members_is_one_error(model, body, param):
    """Pydantic listed an error per member: 130 k of them (within
    max_json_values) held the interpreter lock for 0.3 s to be listed. A
    typed collection stops at its first bad member."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    assert info.value.error_count() <= 2  # a union member's each (a stop string or list)
    assert validation_error(info.value).param.startswith(param)


def test_a_conversation_s_metadata_of_bad_members_is_one_error():
    from lmspd.routes.conversations import CreateConversation, UpdateConversation

    for model in (CreateConversation, UpdateConversation):
        with pytest.raises(ValidationError) as info:
            model.model_validate({"metadata": NUMBER_VALUES})
        assert info.value.error_count() == 1


def test_a_replayed_reasoning_item_of_bad_parts_is_one_error():
    from lmspd.dialects.responses_items import ReasoningIn

    for field in ("summary", "content"):
        with pytest.raises(ValidationError) as info:
            ReasoningIn.model_validate({"type": "reasoning", field: NUMBERS})
        assert info.value.error_count() == 1
