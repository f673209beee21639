"""Write small GGUF headers for tests (metadata only, no tensors)."""

from __future__ import annotations

import struct
from typing import Any

_FORMATS = {"u8": (0, "<B"), "i32": (5, "<i"), "u32": (4, "<I"), "f32": (6, "<f"), "bool": (7, "<?"),
            "u64": (10, "<Q"), "i64": (11, "<q"), "f64": (12, "<d")}


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(value: Any) -> tuple[int, bytes]:
    if isinstance(value, bool):
        return 7, struct.pack("<?", value)
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return 4, struct.pack("<I", value)
        return 11, struct.pack("<q", value)  # (an i64: negative, or past a u32)
    if isinstance(value, float):
        return 6, struct.pack("<f", value)
    if isinstance(value, str):
        return 8, _string(value)
    if isinstance(value, list):
        if not value:
            return 9, struct.pack("<IQ", 4, 0)
        types, blobs = zip(*(_value(v) for v in value), strict=False)
        return 9, struct.pack("<IQ", types[0], len(value)) + b"".join(blobs)
    raise TypeError(type(value))


def gguf_bytes(metadata: dict[str, Any], version: int = 3, tensors: int = 0) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", version, tensors, len(metadata))]
    for key, value in metadata.items():
        vtype, blob = _value(value)
        out.append(_string(key) + struct.pack("<I", vtype) + blob)
    return b"".join(out)


def model_metadata(*, arch: str = "llama", ctx: int = 4096, file_type: int | None = 15,
                   template: str | None = None, name: str = "Test Model") -> dict[str, Any]:
    meta: dict[str, Any] = {"general.architecture": arch, "general.name": name, f"{arch}.context_length": ctx}
    if file_type is not None:
        meta["general.file_type"] = file_type
    meta["tokenizer.ggml.tokens"] = [f"t{i}" for i in range(100)]  # long: skipped, not kept
    if template is not None:
        meta["tokenizer.chat_template"] = template
    return meta


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip(data: bytes, pos: int, vtype: int) -> int:
    if vtype in _SIZES:
        return pos + _SIZES[vtype]
    if vtype == 8:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    item_type, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    for _ in range(count):
        pos = _skip(data, pos, item_type)
    return pos


def with_metadata(source: bytes, extra: dict[str, Any]) -> bytes:
    """A whole GGUF (weights and all) with ``extra`` keys added to its
    metadata: the header grows, so the tensor data is re-aligned after it
    (tensors' offsets count from the data's start and stay as they are)."""
    version, tensors, keys = struct.unpack_from("<IQQ", source, 4)
    pos, alignment = 24, 32
    for _ in range(keys):
        length = struct.unpack_from("<Q", source, pos)[0]
        key = source[pos + 8:pos + 8 + length].decode()
        vtype = struct.unpack_from("<I", source, pos + 8 + length)[0]
        value_at = pos + 12 + length
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", source, value_at)[0]
        pos = _skip(source, value_at, vtype)
    metadata_end = pos
    for _ in range(tensors):
        pos += 8 + struct.unpack_from("<Q", source, pos)[0]  # the name
        dims = struct.unpack_from("<I", source, pos)[0]
        pos += 4 + 8 * dims + 4 + 8  # shape, type, offset
    data_start = pos + (-pos) % alignment
    added = b"".join(_string(k) + struct.pack("<I", vtype) + blob
                     for k, (vtype, blob) in ((k, _value(v)) for k, v in extra.items()))
    header = (source[:4] + struct.pack("<IQQ", version, tensors, keys + len(extra)) + source[24:metadata_end]
              + added + source[metadata_end:pos])
    return header + b"\0" * ((-len(header)) % alignment) + source[data_start:]
