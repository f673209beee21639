"""Rules the message-list dialects share."""

from __future__ import annotations

import pytest

from lmspd.core.errors import ApiError
from lmspd.dialects.common import rename_param, seed32

NAMES = {"max_output_tokens": "max_tokens", "input": "messages", "text.format": "response_format"}
PATHS = ["messages[0]", "messages[1].content[0]", "messages[1].content[1]"]


@pytest.mark.parametrize("param,expected", [
    ("max_output_tokens", "max_tokens"),
    ("input", "messages"),
    ("text.format", "response_format"),
    ("text.format.schema", "response_format.schema"),
    ("input[2].call_id", "messages[1].content[1].call_id"),
    ("input[9]", "messages[9]"),  # no such item: the plain rename still helps
    ("tools", "tools"),
    ("max_output_tokens_x", "max_output_tokens_x"),
    (None, None),
])
def test_rename_param_names_the_clients_field(param, expected):
    assert rename_param(ApiError("invalid_request", "x", param=param), NAMES, PATHS).param == expected


def test_seed_folds_into_uint32():
    assert seed32(None) is None
    assert seed32(7) == 7
    assert seed32(-1) == 2**32 - 1
    assert seed32(2**40 + 5) == 5
