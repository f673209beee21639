"""The provider key: where it comes from, where it is kept, and how it is
kept out of everything else.

Order, the most specific first: the environment variable a model's config
names (``api_key_env``), the key a model's config names (``key_name``)
where it is saved, ``LMSPD_UPSTREAM_API_KEY``, then the key saved as
``default``. A key saved with ``lmspd config set-key`` lives in
``<data dir>/keys/<name>`` — a file created ``0600`` and refused if anyone
else can read it. The value lives in a ``Secret`` whose ``repr``/``str``
never show it, so a stray log line or traceback prints ``Secret('****')``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from lmspd.core.files import private_dir

__all__ = ["DEFAULT_ENV", "CredentialError", "Secret", "clear_key", "key_path", "resolve_key", "save_key"]

DEFAULT_ENV = "LMSPD_UPSTREAM_API_KEY"
DEFAULT_NAME = "default"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
# A key is one line of printable ASCII; anything else is a paste accident
# (and a header injection if it reached the wire).
_KEY = re.compile(r"[\x21-\x7e]{1,4096}\Z")


class CredentialError(Exception):
    """A key that cannot be used; the message never contains the key."""


class Secret:
    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        """``text`` with the key replaced by ``****``, also where JSON wrote it
        (with a backslash before each ``\\`` or ``"`` in it): a provider that
        echoes the key may have escaped it on the way."""
        escaped = json.dumps(self._value)[1:-1]
        if escaped != self._value:
            text = text.replace(escaped, "****")
        return text.replace(self._value, "****")

    def __repr__(self) -> str:
        return "Secret('****')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))


def _check_key(value: str) -> str:
    value = value.strip()
    if not _KEY.match(value):
        raise CredentialError("The key must be one line of printable characters without spaces.")
    return value


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise CredentialError(f"Invalid key name {name!r}: use letters, digits, '.', '_' or '-'.")
    return name


def key_path(data_dir: Path, name: str = DEFAULT_NAME) -> Path:
    return data_dir / "keys" / _check_name(name)


def save_key(data_dir: Path, value: str, name: str = DEFAULT_NAME) -> Path:
    """Write the key atomically, readable by its owner only."""
    value = _check_key(value)
    path = key_path(data_dir, name)
    private_dir(path.parent)  # the data dir too, if this creates it
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # O_EXCL + mode: the file is 0600 from its first byte, never briefly wider.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(value + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def clear_key(data_dir: Path, name: str = DEFAULT_NAME) -> bool:
    path = key_path(data_dir, name)
    if path.exists():
        path.unlink()
        return True
    return False


def _read_key_file(path: Path) -> Secret | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialError(f"{path} is readable by others; run: chmod 600 {path}")
    return Secret(_check_key(path.read_text(encoding="ascii", errors="replace")))


def resolve_key(data_dir: Path, *, env: str | None = None, name: str | None = None) -> Secret | None:
    """The key for one upstream, or None (a local provider needs none).

    ``env``: a variable a model's config names; when it is given it must be
    set (a named but empty variable is a mistake worth stopping for).
    ``name``: a saved key a model's config names; it wins over
    ``LMSPD_UPSTREAM_API_KEY`` (which serves every model without one), and
    where it is not saved that variable still applies.
    """
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise CredentialError(f"The environment variable {env} is not set.")
        return Secret(_check_key(value))
    if name is not None and (named := _read_key_file(key_path(data_dir, name))) is not None:
        return named
    value = os.environ.get(DEFAULT_ENV)
    if value:
        return Secret(_check_key(value))
    return None if name is not None else _read_key_file(key_path(data_dir, DEFAULT_NAME))
