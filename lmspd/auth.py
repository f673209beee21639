"""Bearer credentials: who is asking, and what they may do.

Every stored object belongs to the credential that made it (``owner``), so a
second token sees 404 where the first sees data. With no key configured (only
allowed on loopback) everyone is the one local owner.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request

from lmspd.core.errors import ApiError

ALL_SCOPES = frozenset({"responses:write", "responses:read", "tasks:read", "admin"})


@dataclass(frozen=True)
class Principal:
    owner: str
    scopes: frozenset[str] = ALL_SCOPES

    def require(self, scope: str) -> None:
        if scope not in self.scopes and "admin" not in self.scopes:
            raise ApiError("forbidden", f"This credential lacks the {scope!r} scope.")


LOCAL = Principal(owner="local")


class Authenticator:
    def __init__(self, keys: list[str]) -> None:
        # Keys are compared by digest, in constant time, and never kept in
        # the clear beyond this object.
        self._keys = [(hashlib.sha256(k.encode()).digest(), _owner(k)) for k in keys]

    @property
    def open(self) -> bool:
        return not self._keys

    def authenticate(self, request: Request) -> Principal:
        if not self._keys:
            return LOCAL
        # Either header may carry the key (Anthropic clients send x-api-key,
        # and some send a Bearer token beside it): a valid one is enough.
        for token in (_bearer(request), request.headers.get("x-api-key")):
            if not token:
                continue
            digest = hashlib.sha256(token.encode()).digest()
            match = None
            for known, owner in self._keys:
                if hmac.compare_digest(known, digest):
                    match = owner
            if match is not None:
                return Principal(owner=match)
        raise ApiError("unauthorized", "Missing or invalid API key.", headers={"WWW-Authenticate": "Bearer"})


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def _owner(key: str) -> str:
    return "key_" + hashlib.sha256(b"lmspd-owner:" + key.encode()).hexdigest()[:24]
