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
        return 4, struct.pack("<I", value) if 0 <= value < 2**32 else struct.pack("<q", value)
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
