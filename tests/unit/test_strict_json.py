"""The one strict JSON decoder every route reads its body with (lmspd.bodies)."""

from __future__ import annotations

import gzip
import json
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmspd.bodies import content_encodings, decode_body, decode_json, json_path, parse_json_object
from lmspd.core import strict_json
from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.core.strict_json import count_values, value_bound

# JSON values as the standard library would write them, finite and surrogate-free.
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=30,
)


def refusal(raw: str | bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode_json(raw)
    assert info.value.status == 400
    return info.value


@given(json_values)
def test_every_valid_document_round_trips(value) -> None:
    text = json.dumps(value, ensure_ascii=False)
    assert decode_json(text.encode()) == json.loads(text)


@given(json_values, st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E999"]))
def test_a_non_finite_number_anywhere_is_refused_at_its_path(value, bad) -> None:
    # A placeholder no generated value contains, replaced by the bare token
    # (a value may itself hold the text "NaN").
    hole = "__lmspd_test_placeholder_5e1f__"
    doc = {"a": [value, {"deep": hole}]}
    text = json.dumps(doc, ensure_ascii=False).replace(json.dumps(hole), bad)
    err = refusal(text)
    assert err.param == "a[1].deep"
    assert bad in err.message


@given(st.lists(_text, min_size=1, max_size=5, unique=True), st.data())
def test_a_duplicate_key_is_refused_naming_it(keys, data) -> None:
    key = data.draw(st.sampled_from(keys))
    pairs = ", ".join(f"{json.dumps(k)}: {i}" for i, k in enumerate(keys + [key]))
    err = refusal('{"outer": [{' + pairs + "}]}")
    assert err.param == json_path(("outer", 0, key))
    assert repr(key) in err.message


@given(st.integers(0xD800, 0xDFFF), st.sampled_from(["value", "key"]))
def test_a_lone_surrogate_escape_is_refused(code, where) -> None:
    escape = f"\\u{code:04x}"
    text = ('{"input": [{"text": "%s hi"}]}' % escape if where == "value"
            else '{"input": [{"%s": 1}]}' % escape)
    err = refusal(text)
    assert err.param == "input[0]" + (".text" if where == "value" else "")


def test_a_surrogate_pair_is_text() -> None:
    assert decode_json('{"t": "\\ud83d\\ude00"}') == {"t": "\U0001f600"}


def test_the_refusals_name_the_field() -> None:
    assert refusal('{"temperature": NaN}').param == "temperature"
    assert refusal('{"tools": [{"parameters": {"x-weight": Infinity}}]}').param == 'tools[0].parameters.x-weight'
    err = refusal('{"model": "no-such-model", "model": "real"}')
    assert err.param == "model" and "'model'" in err.message
    assert refusal('{"store": false, "store": true}').param == "store"
    assert refusal("[1, 2, NaN]").param == "[2]"


@given(st.binary(max_size=64))
def test_garbage_is_a_400_never_a_crash(raw) -> None:
    try:
        decode_json(raw)
    except ApiError as exc:
        assert exc.status == 400


def test_an_integer_too_long_to_read_names_its_field() -> None:
    # Not Python's "use sys.set_int_max_str_digits() to increase the limit".
    err = refusal('{"temperature": 1' + "0" * 5000 + "}")
    assert err.param == "temperature"
    assert err.message == "'temperature' is an integer of 5001 digits; the limit is 4300."
    assert refusal('{"a": [-' + "9" * 4301 + "]}").param == "a[0]"
    assert refusal("1" * 4301).message == "The body is an integer of 4301 digits; the limit is 4300."
    assert decode_json('{"seed": ' + "9" * 4300 + "}")["seed"] == int("9" * 4300)


def test_a_long_non_finite_number_is_not_quoted_whole() -> None:
    err = refusal('{"top_p": 1' + "0" * 5000 + ".5}")
    assert err.param == "top_p" and len(err.message) < 120 and "5003 characters" in err.message


def test_nesting_past_the_limit_is_refused() -> None:
    with pytest.raises(ApiError):
        decode_json("[" * 65 + "]" * 65, max_depth=64)
    assert decode_json("[" * 64 + "]" * 64, max_depth=64)
    with pytest.raises(ApiError):
        decode_json("[" * 100_000 + "]" * 100_000)


# -- counting values before parsing ------------------------------------------------

def _values(value) -> int:
    if isinstance(value, list):
        return 1 + sum(map(_values, value))
    if isinstance(value, dict):
        return 1 + sum(map(_values, value.values()))
    return 1


# Strings a counter that did not skip them would count wrong: brackets,
# commas, quotes and backslashes, escaped or not.
_tricky_text = st.text(st.sampled_from(list('[]{},:"\\ ab\n\t\u00e9')), max_size=12)
tricky_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _tricky_text
    | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_tricky_text | _text, inner, max_size=4),
    max_leaves=40,
)


@given(tricky_values, st.sampled_from([None, 0, 2]), st.booleans())
def test_the_count_is_the_number_of_values_the_parser_makes(value, indent, ascii_only) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode()
    count = count_values(text, 10**9)
    assert count == _values(json.loads(text))
    assert value_bound(text) >= count and value_bound(text.decode()) == value_bound(text)


@given(tricky_values)
def test_the_count_stops_once_past_the_limit(value) -> None:
    text = json.dumps([value, value]).encode()
    total = _values(json.loads(text))
    for stop in (1, total // 2, total - 1, total):
        counted = count_values(text, stop)
        assert counted == total if stop >= total else counted > stop


@given(tricky_values, st.integers(2, 9))
def test_a_string_is_skipped_across_the_scans_windows(value, window) -> None:
    # Small windows: escapes and closing quotes fall on every side of an edge.
    text = json.dumps([value, "\\\\\"" * 5, value]).encode()
    with mock.patch.object(strict_json, "_STRING_WINDOW", window):
        assert count_values(text, 10**9) == _values(json.loads(text))


def test_a_string_that_never_closes_ends_the_count() -> None:
    assert count_values(b'["never closed, [1, 2]', 10**9) == 2
    assert count_values(b'["ends in a backslash\\', 10**9) == 2


VALUES = RequestLimits(max_body_bytes=1 << 20, max_json_values=100)


def test_a_body_of_more_values_than_the_limit_is_413_before_it_is_parsed(monkeypatch) -> None:
    at_limit = json.dumps({"input": [0] * 98}).encode()  # the object, the list, 98 numbers
    assert decode_body(at_limit, [], VALUES)["input"] == [0] * 98
    over = json.dumps({"input": [[]] * 99}).encode()
    monkeypatch.setattr("lmspd.bodies.decode_json", lambda *a, **k: pytest.fail("parsed"))
    with pytest.raises(ApiError) as info:
        decode_body(over, [], VALUES)
    assert info.value.status == 413 and info.value.code == "request_too_large"
    assert "more than 100 values" in info.value.message and "max_json_values" in info.value.message
    # Measured after decompression; a WebSocket message the same.
    with pytest.raises(ApiError) as info:
        decode_body(gzip.compress(over), ["gzip"], VALUES)
    assert info.value.status == 413
    with pytest.raises(ApiError) as info:
        parse_json_object(over.decode(), VALUES)
    assert info.value.status == 413 and "JSON message" in info.value.message


def test_brackets_and_commas_inside_strings_are_not_values() -> None:
    # Source code sent as text: far above the limit on the quick bound.
    code = "f(a, b)[0] = {x, y};\n" * 200
    body = json.dumps({"model": "m", "input": [{"role": "user", "content": code}] * 3}).encode()
    assert value_bound(body) > VALUES.max_json_values
    assert decode_body(body, [], VALUES)["input"][2]["content"] == code
    assert parse_json_object(body.decode(), VALUES)["model"] == "m"


# -- Content-Encoding --------------------------------------------------------------

LIMITS = RequestLimits(max_body_bytes=4096)


def test_gzip_and_zstd_bodies_decode() -> None:
    import zstandard

    body = json.dumps({"input": "hi " * 100}).encode()
    assert decode_body(gzip.compress(body), ["gzip"], LIMITS) == json.loads(body)
    assert decode_body(zstandard.ZstdCompressor().compress(body), ["zstd"], LIMITS) == json.loads(body)
    # Several members, and codings applied in turn.
    assert decode_body(gzip.compress(body[:10]) + gzip.compress(body[10:]), ["gzip"], LIMITS) == json.loads(body)
    both = zstandard.ZstdCompressor().compress(gzip.compress(body))
    assert decode_body(both, ["gzip", "zstd"], LIMITS) == json.loads(body)


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_a_zip_bomb_is_a_413_after_one_limit_of_output(coding) -> None:
    import zstandard

    bomb_plain = b'{"input": "' + b" " * (64 * 1024 * 1024) + b'"}'
    bomb = gzip.compress(bomb_plain) if coding == "gzip" else zstandard.ZstdCompressor().compress(bomb_plain)
    assert len(bomb) < 1024 * 1024
    with pytest.raises(ApiError) as info:
        decode_body(bomb, [coding], LIMITS)
    assert info.value.status == 413


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_corrupt_compressed_bodies_are_400(coding) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(b"\x1f\x8b not really", [coding], LIMITS)
    assert info.value.status == 400
    with pytest.raises(ApiError) as info:
        decode_body(gzip.compress(b'{"a": 1}')[:-6], ["gzip"], LIMITS)
    assert info.value.status == 400


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
@pytest.mark.parametrize("cut", [1, 4, 40])
def test_a_compressed_body_cut_short_says_so(coding, cut) -> None:
    """Not an empty or half body handed to the JSON decoder (whose error
    would blame the JSON): the compressed data itself ends early."""
    import zstandard

    body = json.dumps({"input": "hi " * 300, "n": list(range(200))}).encode()
    packed = gzip.compress(body) if coding == "gzip" else zstandard.ZstdCompressor().compress(body)
    # Also when a whole first frame or member came before the cut one.
    for data in (packed[:-cut], packed + packed[:-cut]):
        with pytest.raises(ApiError) as info:
            decode_body(data, [coding], LIMITS)
        assert info.value.status == 400 and info.value.code == "invalid_request"
        assert f"not valid {coding} data" in info.value.message and "ends early" in info.value.message


def test_unknown_encodings_are_415() -> None:
    for header in ("br", "deflate, gzip", "compress"):
        with pytest.raises(ApiError) as info:
            content_encodings(header, LIMITS)
        assert info.value.status == 415
    assert content_encodings("identity", LIMITS) == []
    assert content_encodings("gzip, zstd", LIMITS) == ["gzip", "zstd"]


def test_stacked_codings_past_the_limit_are_415_before_any_decoding() -> None:
    """Each layer may inflate to the body limit: the header's list is what
    bounds the work, so it is refused as read (identity layers cost nothing)."""
    assert content_encodings("gzip, identity, zstd, identity", LIMITS) == ["gzip", "zstd"]
    with pytest.raises(ApiError) as info:
        content_encodings("gzip, " * 2000 + "gzip", LIMITS)
    assert info.value.status == 415
    assert "2001 codings; the limit is 2" in info.value.message
