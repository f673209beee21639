"""Bearer credentials: who is asking, and what they may do.

Every stored object belongs to the credential that made it (``owner``), so a
second token sees 404 where the first sees data. With no key configured (only
allowed on loopback) everyone is the one local owner, with every scope.

A key may carry scopes (``--api-key KEY:responses:read,tasks:read``, or a line
``KEY responses:read,tasks:read`` in ``--api-keys-file``); a key given without
any keeps all of them, as before scopes could be given. ``admin`` implies
every other scope. Which scope each route needs is the table in README.md
(Auth); the handlers ask for it through ``lmspd.http.principal``. The
owner is derived from the key alone, so changing a key's scopes keeps its data.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from lmspd.core.errors import ApiError

ALL_SCOPES = frozenset({"responses:write", "responses:read", "tasks:read", "admin"})
# Named by DESIGN.md for tools lmspd may one day run itself; accepted, grants nothing yet.
RESERVED_SCOPES = frozenset({"tools:execute"})
_SCOPE_SYNTAX = re.compile(r"[a-z_]+(:[a-z_]+)?\Z")
_COMMENT = re.compile(r"(^|\s)#.*")


@dataclass(frozen=True)
class Principal:
    owner: str
    scopes: frozenset[str] = ALL_SCOPES

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes

    def require(self, scope: str) -> None:
        if not self.allows(scope):
            raise ApiError("forbidden", f"This credential lacks the {scope!r} scope.")


LOCAL = Principal(owner="local")


@dataclass(frozen=True)
class KeySpec:
    key: str
    scopes: frozenset[str]


def parse_key(spec: str) -> KeySpec:
    """``KEY`` (every scope) or ``KEY:scope,scope``. A suffix that does not
    look like a scope list is part of the key (keys may contain ``:``); one
    that does but names an unknown scope is an error, never a silent key."""
    key, sep, rest = spec.partition(":")
    names = [s.strip() for s in rest.split(",")] if sep else []
    if not sep or not rest or not all(_SCOPE_SYNTAX.match(n) for n in names):
        if not spec.strip():
            raise ValueError("an API key must not be empty")
        return KeySpec(spec, ALL_SCOPES)
    unknown = sorted(set(names) - ALL_SCOPES - RESERVED_SCOPES)
    if unknown:
        raise ValueError(f"unknown API key scope {', '.join(unknown)} (known: {', '.join(sorted(ALL_SCOPES))})")
    if not key:
        raise ValueError("an API key must not be empty")
    return KeySpec(key, frozenset(names))


def read_keys_file(path: Path) -> list[str]:
    """One key per line, optionally followed by whitespace and its scopes
    (``KEY responses:read,tasks:read``) or written ``KEY:scopes``; ``#`` at
    the start of a line or after whitespace starts a comment. Returned as
    ``--api-key`` specs. A file with no key in it is an error: the server
    would otherwise start open while its operator believes it keyed."""
    specs = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = _COMMENT.sub("", line).strip()
        if not line:
            continue
        key, *rest = line.split(None, 1)
        scopes = re.sub(r"\s", "", rest[0]) if rest else ""
        spec = f"{key}:{scopes}" if scopes else key
        try:
            parsed = parse_key(spec)
            # Text after the key that is no scope list would otherwise join
            # the key (``parse_key``'s rule for ``--api-key``): a key the
            # writer never meant, silently.
            if scopes and parsed.key != key:
                raise ValueError(f"what follows the key is not a list of scopes (known: {', '.join(sorted(ALL_SCOPES))})")
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        specs.append(spec)
    if not specs:
        raise ValueError(f"{path} holds no API key (every line is empty or a comment; a line starting with "
                         "'#' is a comment, so a key cannot start with '#')")
    return specs


class Authenticator:
    def __init__(self, keys: list[str]) -> None:
        # Keys are compared by digest, in constant time, and never kept in
        # the clear beyond this object.
        self._keys = []
        for spec in keys:
            parsed = parse_key(spec)
            self._keys.append((hashlib.sha256(parsed.key.encode()).digest(), _owner(parsed.key), parsed.scopes))

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
            for known, owner, scopes in self._keys:
                if hmac.compare_digest(known, digest):
                    match = Principal(owner=owner, scopes=scopes)
            if match is not None:
                return match
        raise ApiError("unauthorized", "Missing or invalid API key.", headers={"WWW-Authenticate": "Bearer"})


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def _owner(key: str) -> str:
    return "key_" + hashlib.sha256(b"lmspd-owner:" + key.encode()).hexdigest()[:24]
