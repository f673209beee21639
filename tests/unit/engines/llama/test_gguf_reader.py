"""The bounded GGUF header reader: real files, truncation, corruption."""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import SamplingDefaults
from lmspd.engines.llama.gguf import MAX_STRING_BYTES, GGUFError, SkippedArray, parse, read_gguf, sampling_defaults
from lmspd.engines.llama.models import resolve_model
from support.gguf_writer import gguf_bytes, model_metadata

QWEN_LIKE = ("{% if tools %}<|im_start|>system\n# Tools{% for t in tools %}{{ t | tojson }}{% endfor %}"
             "<tool_call>{% endif %}{% for m in messages %}<think>{{ m.content }}{% endfor %}")


@pytest.fixture(scope="module")
def bundled() -> bytes:
    _, path = resolve_model(None)
    with open(path, "rb") as fh:
        return fh.read(4 * 1024 * 1024)  # the header is well inside this


def test_the_bundled_model_reads_without_loading_it():
    _, path = resolve_model(None)
    info = read_gguf(path)
    assert info.architecture == "llama"
    assert info.context_length == 8192
    assert info.quantization(path.name) == "Q4_1"
    assert info.capabilities == {"tools": False, "reasoning": False}
    assert "{% for message in messages %}" in (info.chat_template or "")
    assert isinstance(info.metadata["tokenizer.ggml.tokens"], SkippedArray)
    assert info.metadata["tokenizer.ggml.tokens"].length == 49152


def test_capabilities_come_from_the_chat_template():
    info = parse(io.BytesIO(gguf_bytes(model_metadata(template=QWEN_LIKE, file_type=15))))
    assert info.capabilities == {"tools": True, "reasoning": True}
    assert info.quantization() == "Q4_K_M"
    assert info.context_length == 4096
    # Without general.file_type, the quantization is read from the file name.
    bare = parse(io.BytesIO(gguf_bytes(model_metadata(file_type=None))))
    assert bare.quantization("Llama-3.2-1B-Instruct-Q5_K_S.gguf") == "Q5_K_S"
    assert bare.quantization("model.gguf") is None


@pytest.mark.parametrize("blob, message", [
    (b"GGML" + b"\0" * 20, "bad magic"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 10**9), "metadata keys"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 10**12), "string"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), "value type"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 10**12),
     "array"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 8)
     + struct.pack("<Q", MAX_STRING_BYTES + 1), "string"),
])
def test_hostile_headers_are_refused_before_allocating(blob, message):
    with pytest.raises(GGUFError, match=message):
        parse(io.BytesIO(blob))


def test_nested_small_arrays_cannot_multiply_without_bound():
    # 64 x 64 x 64 one-byte values: each array is "small", the whole is not.
    leaf = struct.pack("<IQ", 0, 64) + b"\1" * 64
    mid = struct.pack("<IQ", 9, 64) + leaf * 64
    top = struct.pack("<IQ", 9, 64) + mid * 64
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9) + top
    with pytest.raises(GGUFError, match="small arrays"):
        parse(io.BytesIO(blob))


def test_a_missing_file_is_a_gguf_error(tmp_path):
    with pytest.raises(GGUFError, match="cannot read"):
        read_gguf(tmp_path / "nope.gguf")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=200_000))
def test_a_truncated_real_header_is_an_error_never_a_crash(bundled, cut):
    # The bundled header is ~1.3 MB (the vocabulary); any cut inside it fails cleanly.
    with pytest.raises(GGUFError):
        parse(io.BytesIO(bundled[:cut]))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_corrupted_headers_parse_or_fail_cleanly(data):
    blob = bytearray(gguf_bytes(model_metadata(template=QWEN_LIKE)))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    try:
        info = parse(io.BytesIO(bytes(blob)))
    except GGUFError:
        return
    # Whatever parsed is well-typed enough to describe.
    assert isinstance(info.metadata, dict)
    _ = info.capabilities
    info.quantization("x.gguf")
    _ = info.context_length


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_crash(blob):
    try:
        parse(io.BytesIO(b"GGUF" + blob))
    except GGUFError:
        pass


def test_a_model_s_sampling_settings_are_read_from_its_header_or_llama_cpp_s_strings():
    header = parse(io.BytesIO(gguf_bytes({"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                          "general.sampling.top_p": 0.95, "general.sampling.min_p": 0.05})))
    assert sampling_defaults(header.metadata) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)
    # llama.cpp's metadata() gives every value as a string.
    strings = {"general.sampling.temp": "0.600000", "general.sampling.top_k": "20"}
    assert sampling_defaults(strings) == SamplingDefaults(temperature=0.6, top_k=20)
    assert sampling_defaults(strings).describe() == "temperature 0.6, top_k 20"
    assert sampling_defaults({}).describe() == "none"


@pytest.mark.parametrize(("key", "value"), [
    # Values that turn the sampler off (Spark-style "top_k -1") and values out of range are left out.
    ("top_k", -1), ("top_k", 0), ("top_p", 1.0), ("top_p", 0.0), ("min_p", 0.0), ("min_p", 1.5),
    ("temp", -0.1), ("temp", 3.0), ("temp", "warm"), ("temp", True), ("temp", [0.6]),
])
def test_sampling_settings_that_do_nothing_or_make_no_sense_are_left_out(key, value):
    assert sampling_defaults({f"general.sampling.{key}": value}) == SamplingDefaults()


def test_the_test_writer_s_integers_read_back_whatever_their_sign_or_size():
    values = {"a": 7, "b": -1, "c": 2**40, "general.sampling.top_k": -1}
    assert parse(io.BytesIO(gguf_bytes(values))).metadata == values
