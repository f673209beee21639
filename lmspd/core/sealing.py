"""``reasoning.encrypted_content``: hidden reasoning, sealed for the client to carry.

A stateless client (Codex, pi) replays the reasoning items it received. The
blob lets lmspd render the turn exactly as the model produced it, so that the
prompt's prefix matches the KV (or a disk checkpoint) even after a restart or
on another instance with the same key. AES-256-GCM: opaque to the client and
authenticated, so a tampered blob is rejected, never rendered.

A blob is bound to the credential (owner) it was issued to: the AEAD's
associated data names it, so another key's blob fails authentication like
a tampered one. The model it was sealed for is inside: replayed to another
model (a client that switched models mid-conversation), it opens to
nothing, and that turn renders without hidden reasoning, as a visible-only
replay does; it is not another model's to render, and refusing it failed
every later turn of the conversation.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lmspd.core.errors import ApiError
from lmspd.core.files import private_dir, private_file

# l2: bound to model and owner (l1 blobs, bound to the model only, no longer
# open); still what compaction items (``seal_value``) are, and still opened.
_VERSION = b"l2"
# l3: reasoning bound to its owner, with its model inside (``seal``).
_REASONING = b"l3"


class Sealer:
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @classmethod
    def from_data_dir(cls, data_dir: Path) -> "Sealer":
        """The server key lives in the data dir (0600), made on first use."""
        path = Path(data_dir) / "reasoning.key"
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            key = cls._make_key(path)
        else:
            # A key left readable by others (copied in, an older version):
            # whoever reads it can forge and open every owner's sealed
            # reasoning. Closed, as the store and the upstream keys are.
            private_file(path)
        if len(key) != 32:
            raise ValueError(f"{path} is not a 32-byte key")
        return cls(key)

    @staticmethod
    def _make_key(path: Path) -> bytes:
        """Written whole under another name, then linked into place: two
        servers starting on one data dir at once both end with the key
        that got there first, never with a half-written file."""
        private_dir(path.parent)
        key = AESGCM.generate_key(bit_length=256)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".reasoning.key.")
        try:
            with os.fdopen(fd, "wb") as fh:  # mkstemp: 0600
                fh.write(key)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:
                # A filesystem without hard links: created exclusively instead.
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(key)
        except FileExistsError:
            return path.read_bytes()
        finally:
            os.unlink(tmp)
        return key

    @staticmethod
    def sealed_by_lmspd(blob: str) -> bool:
        """Whether ``blob`` has the form lmspd seals in (under any key):
        another provider's reasoning blob (OpenAI's, replayed by a session
        that began there) has not. Only such a blob is passed over; one of
        ours that does not open is refused (``open``). Judged by its first
        four characters (the version and a nonce byte), so that one of ours
        cut short or with a character dropped is still ours, and refused."""
        try:
            head = base64.urlsafe_b64decode(blob[:4].encode())
        except ValueError:  # binascii.Error, and non-ASCII text, included
            return False
        return head.startswith((_VERSION, _REASONING))

    def seal(self, model: str, hidden: str, owner: str = "local") -> str:
        nonce = os.urandom(12)
        plain = json.dumps({"hidden": hidden, "model": model}, ensure_ascii=False).encode()
        sealed = self._aead.encrypt(nonce, plain, _owner_bound(owner))
        return base64.urlsafe_b64encode(_REASONING + nonce + sealed).decode()

    def seal_value(self, purpose: str, value: dict[str, Any], owner: str = "local") -> str:
        """Any other server-made blob a client carries (a compaction's
        summary): bound to its ``purpose``, so that one kind of blob never
        opens as another; and to its owner, as ``seal``."""
        nonce = os.urandom(12)
        plain = json.dumps(value, ensure_ascii=False).encode()
        sealed = self._aead.encrypt(nonce, plain, _purpose_bound(purpose, owner))
        return base64.urlsafe_b64encode(_VERSION + nonce + sealed).decode()

    def open_value(self, purpose: str, blob: str, param: str, owner: str = "local") -> dict[str, Any]:
        try:
            raw = _unb64(blob)
            if not raw.startswith(_VERSION):
                raise ValueError("unknown version")
            nonce, sealed = raw[2:14], raw[14:]
            value = json.loads(self._aead.decrypt(nonce, sealed, _purpose_bound(purpose, owner)))
            if not isinstance(value, dict):
                raise ValueError("not an object")
            return value
        except (ValueError, InvalidTag, TypeError):
            raise ApiError(
                "invalid_request",
                f"'{param}' is not valid: it was altered, or was issued by another server key or API key.",
                param=param,
            ) from None

    def open(self, model: str, blob: str, param: str, owner: str = "local") -> str | None:
        """The hidden reasoning in ``blob``, or None where ``owner``'s blob
        was sealed for another model (``seal``). Refused (400, naming
        ``param``) where it does not open: altered, or another key's."""
        try:
            raw = _unb64(blob)
            version, nonce, sealed = raw[:2], raw[2:14], raw[14:]
            if version == _REASONING:
                value = json.loads(self._aead.decrypt(nonce, sealed, _owner_bound(owner)))
                hidden, sealed_for = value["hidden"], value["model"]
                if not isinstance(hidden, str) or not isinstance(sealed_for, str):
                    raise ValueError("not a reasoning blob")
                return hidden if sealed_for == model else None
            if version != _VERSION:
                raise ValueError("unknown version")
            # An l2 blob names its model only in the associated data: another
            # model's fails like another key's.
            hidden = json.loads(self._aead.decrypt(nonce, sealed, _bound_to(model, owner)))["hidden"]
            if not isinstance(hidden, str):
                raise ValueError("not a reasoning blob")
            return hidden
        except (ValueError, InvalidTag, KeyError, TypeError):
            raise ApiError(
                "invalid_request",
                "encrypted_content is not valid: it was altered, or was issued by another server "
                "key, model or API key.",
                param=param,
            ) from None


def _unb64(blob: str) -> bytes:
    """The bytes of a blob this server issued, only from the exact string
    it issued: base64 decoders skip characters outside the alphabet and
    bits past the last byte, so many strings decode alike and an edited
    blob would still open."""
    raw = base64.urlsafe_b64decode(blob.encode())
    if base64.urlsafe_b64encode(raw).decode() != blob:
        raise ValueError("not in the form this server writes")
    return raw


def _bound_to(model: str, owner: str) -> bytes:
    # Length-prefixed, so that no (model, owner) pair can spell another's.
    m, o = model.encode(), owner.encode()
    return _VERSION + len(m).to_bytes(4, "big") + m + o


def _owner_bound(owner: str) -> bytes:
    # The version first keeps these apart from l2's associated data.
    return _REASONING + b"reasoning:" + owner.encode()


def _purpose_bound(purpose: str, owner: str) -> bytes:
    # "purpose:" keeps these apart from (model, owner) reasoning blobs.
    p, o = purpose.encode(), owner.encode()
    return _VERSION + b"purpose:" + len(p).to_bytes(4, "big") + p + o
