"""The one strict JSON decoder every route reads its body with (lmspd.bodies)."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmspd.bodies import content_encodings, decode_body, decode_json, json_path
from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits

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


def test_nesting_past_the_limit_is_refused() -> None:
    with pytest.raises(ApiError):
        decode_json("[" * 65 + "]" * 65, max_depth=64)
    assert decode_json("[" * 64 + "]" * 64, max_depth=64)
    with pytest.raises(ApiError):
        decode_json("[" * 100_000 + "]" * 100_000)


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
