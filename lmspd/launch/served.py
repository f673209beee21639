"""What a running lmspd serves, as the clients' configurations need it.

``GET /lmsp/v1/models`` lists the served models with their context window
and capabilities (``reasoning``: the chat template has a ``<think>`` block;
``tools``). The reply is bounded before it is parsed: a launch talks to a
server the user named, not necessarily one lmspd runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx

# A model list is a few hundred bytes a model; a megabyte is thousands.
MAX_MODELS_BYTES = 1 << 20
MAX_MODELS = 256


class ServerUnavailable(Exception):
    """Nothing answers at the URL (refused, timed out): a server may be started."""


class ServerRefused(Exception):
    """Something answered, but not with a model list lmspd can use."""


@dataclass(frozen=True)
class ServedModel:
    id: str
    context_window: int
    reasoning: bool
    tools: bool
    # What a launch asks the client to request per answer at most
    # (``lmspd launch --max-output-tokens``); None: ``output_budget``'s rule.
    max_output_tokens: int | None = None


def read_served(base_url: str, api_key: str | None, *, timeout: float = 10.0) -> list[ServedModel]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=timeout) as client, \
                client.stream("GET", base_url.rstrip("/") + "/lmsp/v1/models", headers=headers) as reply:
            body = b""
            for chunk in reply.iter_bytes():
                body += chunk
                if len(body) > MAX_MODELS_BYTES:
                    raise ServerRefused(f"{base_url}: the model list is larger than {MAX_MODELS_BYTES} bytes")
            status = reply.status_code
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ServerUnavailable(f"no server answers at {base_url} ({exc.__class__.__name__})") from exc
    except httpx.HTTPError as exc:
        raise ServerRefused(f"{base_url}: {exc}") from exc
    if status in (401, 403):
        raise ServerRefused(f"{base_url} refused the key (HTTP {status}): pass --api-key or set LMSPD_API_KEY")
    if status != 200:
        raise ServerRefused(f"{base_url}/lmsp/v1/models answered HTTP {status}: is it lmspd?")
    return parse_models(body, base_url)


def parse_models(body: bytes, base_url: str = "the server") -> list[ServedModel]:
    try:
        data = json.loads(body)
        rows = data["data"]
        if not isinstance(rows, list):
            raise TypeError("data is not a list")
        models = []
        for row in rows[:MAX_MODELS]:
            caps = row.get("capabilities") or {}
            window = row["context_window"]
            if not isinstance(row["id"], str) or not row["id"] or type(window) is not int or window <= 0:
                raise ValueError(f"a model without an id or a context window: {str(row)[:200]}")
            models.append(ServedModel(id=row["id"], context_window=window, reasoning=bool(caps.get("reasoning")),
                                      tools=bool(caps.get("tools", True))))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServerRefused(f"{base_url}/lmsp/v1/models is not an lmspd model list ({exc})") from exc
    if not models:
        raise ServerRefused(f"{base_url} serves no model")
    return models
