"""Rules the message-list dialects share."""

from __future__ import annotations

import pytest

from lmspd.core.errors import FIELD, ApiError, RequestField
from lmspd.dialects.common import seed32
from lmspd.dialects.fields import FieldNames, responses_items

NAMES = FieldNames({RequestField.MAX_OUTPUT_TOKENS: "max_tokens", RequestField.ITEMS: "messages",
                    RequestField.OUTPUT_FORMAT: "response_format"},
                   ["messages[0]", "messages[1].content[0]", "messages[1].content[1]"])


@pytest.mark.parametrize("path,expected", [
    ((RequestField.MAX_OUTPUT_TOKENS,), "max_tokens"),
    ((RequestField.ITEMS,), "messages"),
    ((RequestField.OUTPUT_FORMAT,), "response_format"),
    ((RequestField.OUTPUT_FORMAT, "schema"), "response_format.schema"),
    ((RequestField.ITEMS, 2, "call_id"), "messages[1].content[1].call_id"),
    ((RequestField.ITEMS, 9, "call_id"), "messages"),  # no such item: the list is all it can name
    ((RequestField.TOOLS, 0), "tools[0]"),  # not renamed: its neutral name
])
def test_field_names_name_the_clients_field(path, expected):
    exc = ApiError("invalid_request", f"Bad {FIELD}.", path=path)
    assert NAMES.name(exc).param == expected
    assert exc.message == str(exc) == f"Bad {expected}."


def test_an_error_that_names_its_param_keeps_it():
    exc = ApiError("invalid_request", "x", param="messages[0].role")
    assert NAMES.name(exc).param == "messages[0].role"


def test_an_unnamed_path_reads_neutrally():
    exc = ApiError("invalid_request", f"Bad {FIELD}.", path=(RequestField.ITEMS, 3, "call_id"))
    assert (exc.param, exc.message) == ("items[3].call_id", "Bad items[3].call_id.")


def test_responses_item_paths_skip_the_stored_history():
    history, own = [object(), object()], [object()]
    assert responses_items(history + own, own) == [None, None, "input[0]"]
    # Not history + input (a compacted window): nothing is named.
    assert responses_items([object(), *own[:0], object()], own) == []


def test_seed_folds_into_uint32():
    assert seed32(None) is None
    assert seed32(7) == 7
    assert seed32(-1) == 2**32 - 1
    assert seed32(2**40 + 5) == 5
