"""Reading a GGUF file's metadata header without loading the model.

Only the key/value section is parsed; tensors are never touched. Every
read is bounded (key count, string and array lengths, nesting, bytes
scanned), so a truncated or hostile file raises :class:`GGUFError` instead
of allocating without limit. Large arrays (the tokenizer's vocabulary and
merges) are skipped, keeping only their length.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(little-endian; versions 2 and 3).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Mapping

from lmspd.core.conversation import SamplingDefaults

MAGIC = b"GGUF"
MAX_KEYS = 65_536
MAX_KEY_BYTES = 65_536
# Chat templates run to tens of KiB; nothing we read is near this.
MAX_STRING_BYTES = 4 * 1024 * 1024
MAX_ARRAY_ITEMS = 16 * 1024 * 1024
MAX_DEPTH = 4
# Arrays at most this long are kept (small ones: e.g. a list of EOS ids).
KEEP_ARRAY_ITEMS = 64
# Values kept in small arrays, all arrays together (nesting multiplies).
MAX_KEPT_VALUES = 65_536
# Bytes of header we are willing to scan (the vocabulary is most of it).
MAX_HEADER_BYTES = 256 * 1024 * 1024

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# llama.cpp's LLAMA_FTYPE (general.file_type) -> the name quantizers print.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE",
}
_QUANT_IN_NAME = re.compile(r"(?<![A-Za-z0-9])(I?Q\d_[A-Z0-9_]+|Q\d_\d|BF16|F16|F32)(?![A-Za-z0-9])", re.I)
_RENDERS_TOOLS = re.compile(r"\btools\b")


class GGUFError(ValueError):
    """Not a GGUF file we can read (truncated, corrupt, or over a limit)."""


@dataclass(frozen=True)
class SkippedArray:
    """An array too long to keep; only its element type and length."""

    item_type: int
    length: int


@dataclass(frozen=True)
class GGUFInfo:
    version: int
    tensor_count: int
    metadata: dict[str, Any]

    @property
    def architecture(self) -> str | None:
        return _str(self.metadata.get("general.architecture"))

    @property
    def name(self) -> str | None:
        return _str(self.metadata.get("general.name"))

    @property
    def context_length(self) -> int | None:
        arch = self.architecture
        value = self.metadata.get(f"{arch}.context_length") if arch else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def chat_template(self) -> str | None:
        return _str(self.metadata.get("tokenizer.chat_template"))

    def quantization(self, filename: str = "") -> str | None:
        ftype = self.metadata.get("general.file_type")
        if isinstance(ftype, int) and ftype in FILE_TYPES:
            return FILE_TYPES[ftype]
        return quantization_from_name(filename)

    @property
    def capabilities(self) -> dict[str, bool]:
        """What the chat template can render: native tool calls, reasoning."""
        t = self.chat_template or ""
        return {"tools": bool(_RENDERS_TOOLS.search(t)),
                "reasoning": "<think>" in t or "reasoning_content" in t}


def sampling_defaults(metadata: Mapping[str, Any]) -> SamplingDefaults:
    """The model's own sampling settings (``general.sampling.temp``,
    ``.top_p``, ``.top_k``, ``.min_p``: llama.cpp's keys), from this module's
    header or llama.cpp's metadata (where every value is a string). A value
    out of its range, or one that turns the sampler off (top-k 0, top-p 1,
    min-p 0), is left out."""

    def number(key: str, low: float, high: float) -> float | None:
        value = metadata.get(f"general.sampling.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            return None
        try:
            x = float(value)
        except ValueError:
            return None
        return x if low <= x <= high else None

    temperature = number("temp", 0.0, 2.0)
    top_p = number("top_p", 1e-6, 1.0)
    top_k = number("top_k", 1.0, 1e9)
    min_p = number("min_p", 1e-6, 1.0)
    return SamplingDefaults(
        temperature=None if temperature is None else round(temperature, 6),
        top_p=None if top_p is None or top_p >= 1.0 else round(top_p, 6),
        top_k=None if top_k is None else int(top_k),
        min_p=None if min_p is None else round(min_p, 6))


def quantization_from_name(filename: str) -> str | None:
    m = _QUANT_IN_NAME.search(filename)
    return m.group(1).upper() if m else None


def read_gguf(path: str | Path) -> GGUFInfo:
    """The header of the GGUF at ``path``; :class:`GGUFError` if it is not one."""
    try:
        with open(path, "rb", buffering=1 << 16) as fh:
            return parse(fh)
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc.strerror or exc}") from None


def parse(fh: IO[bytes]) -> GGUFInfo:
    r = _Reader(fh)
    if r.take(4) != MAGIC:
        raise GGUFError("not a GGUF file (bad magic)")
    version = r.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"unsupported GGUF version {version}")
    tensor_count = r.scalar("<Q")
    kv_count = r.scalar("<Q")
    if kv_count > MAX_KEYS:
        raise GGUFError(f"{kv_count} metadata keys (limit {MAX_KEYS})")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = r.string(MAX_KEY_BYTES)
        metadata[key] = r.value(r.scalar("<I"), 0)
    return GGUFInfo(version=version, tensor_count=tensor_count, metadata=metadata)


class _Reader:
    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._read = 0
        self._kept = 0

    def take(self, n: int) -> bytes:
        self._read += n
        if self._read > MAX_HEADER_BYTES:
            raise GGUFError(f"metadata larger than {MAX_HEADER_BYTES} bytes")
        data = self._fh.read(n)
        if len(data) != n:
            raise GGUFError("truncated GGUF header")
        return data

    def skip(self, n: int) -> None:
        # Reading (not seeking) also proves the bytes exist: a truncated
        # file fails here rather than after a seek past its end.
        while n > 0:
            step = min(n, 1 << 20)
            self.take(step)
            n -= step

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int = MAX_STRING_BYTES) -> str:
        n = self.scalar("<Q")
        if n > limit:
            raise GGUFError(f"a {n}-byte string (limit {limit})")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFError(f"unknown metadata value type {vtype}")
        if depth >= MAX_DEPTH:
            raise GGUFError("arrays nested too deep")
        item_type = self.scalar("<I")
        length = self.scalar("<Q")
        if length > MAX_ARRAY_ITEMS:
            raise GGUFError(f"an array of {length} items (limit {MAX_ARRAY_ITEMS})")
        if length <= KEEP_ARRAY_ITEMS:
            self._kept += length
            if self._kept > MAX_KEPT_VALUES:
                raise GGUFError(f"more than {MAX_KEPT_VALUES} values in small arrays")
            return [self.value(item_type, depth + 1) for _ in range(length)]
        if item_type in _SCALARS:
            self.skip(length * struct.calcsize(_SCALARS[item_type]))
        else:
            for _ in range(length):
                self._skip_value(item_type, depth + 1)
        return SkippedArray(item_type, length)

    def _skip_value(self, vtype: int, depth: int) -> None:
        if vtype == _STRING:
            n = self.scalar("<Q")
            if n > MAX_STRING_BYTES:
                raise GGUFError(f"a {n}-byte string (limit {MAX_STRING_BYTES})")
            self.skip(n)
        else:
            self.value(vtype, depth)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
