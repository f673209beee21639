"""Bearer credentials (lmspd.auth): who is asking. Scopes per route are
tested through the app in tests/unit/routes/test_scopes.py."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from lmspd.auth import ALL_SCOPES, LOCAL, Authenticator
from lmspd.core.errors import ApiError


def request(**headers: str) -> Request:
    raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw})


def test_without_keys_everyone_is_the_local_owner_with_every_scope() -> None:
    auth = Authenticator([])
    assert auth.open and auth.authenticate(request()) is LOCAL
    assert LOCAL.scopes == ALL_SCOPES


def test_bearer_and_x_api_key_and_a_stale_bearer_beside_a_valid_key() -> None:
    auth = Authenticator(["k1", "k2:responses:read"])
    a = auth.authenticate(request(authorization="Bearer k1"))
    assert a.scopes == ALL_SCOPES
    assert auth.authenticate(request(authorization="bearer  k1 ")) == a  # scheme is case-insensitive
    assert auth.authenticate(request(x_api_key="k1")) == a
    assert auth.authenticate(request(authorization="Bearer stale", x_api_key="k1")) == a
    b = auth.authenticate(request(authorization="Bearer k2"))
    assert b.owner != a.owner and b.scopes == {"responses:read"}
    assert b.allows("responses:read") and not b.allows("tasks:read")
    with pytest.raises(ApiError) as info:
        b.require("responses:write")
    assert info.value.code == "forbidden"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope"}, {"authorization": "Basic azE="},
                                     {"authorization": "Bearer "}, {"x_api_key": "K1"}])
def test_anything_else_is_401_with_a_challenge(headers) -> None:
    with pytest.raises(ApiError) as info:
        Authenticator(["k1"]).authenticate(request(**headers))
    assert info.value.code == "unauthorized" and info.value.headers["WWW-Authenticate"] == "Bearer"


def test_the_owner_is_the_key_alone_and_never_the_key_itself() -> None:
    full = Authenticator(["secret-key"]).authenticate(request(authorization="Bearer secret-key"))
    scoped = Authenticator(["secret-key:tasks:read"]).authenticate(request(authorization="Bearer secret-key"))
    assert full.owner == scoped.owner, "changing a key's scopes keeps its data"
    assert "secret-key" not in full.owner


def test_admin_implies_every_scope() -> None:
    p = Authenticator(["k:admin"]).authenticate(request(authorization="Bearer k"))
    assert all(p.allows(s) for s in ALL_SCOPES)
