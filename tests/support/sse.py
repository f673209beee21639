"""A small, strict SSE reader for tests (independent of lmspd's own code)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Iterator


@dataclass
class Frame:
    event: str | None
    data: str
    id: str | None

    def json(self) -> dict:
        return json.loads(self.data)


def parse_frames(lines: Iterable[str]) -> Iterator[Frame]:
    event = id_ = None
    data: list[str] = []
    for line in lines:
        line = line.rstrip("\r\n")
        if line == "":
            if data or event:
                yield Frame(event, "\n".join(data), id_)
            event = id_ = None
            data = []
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            id_ = value
    if data:
        raise AssertionError(f"stream ended inside an event: {data!r}")
