"""Disk checkpoints: exact KV state, keyed by the text a client can replay.

One file per checkpoint, written atomically (a temp file of its own, fsync,
rename) with a SHA-256 over header and payload. A file that fails any
check — magic, checksum, model fingerprint — is removed, never loaded. The
directory has a byte budget, shared fairly by the owners (API keys) and
kept from the start: the least recently used checkpoints of the owners over
their share (lmspd.core.fairness) go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lmspd.core.fairness import over_share
from lmspd.core.files import FILE_MODE, private_dir

from .state import SessionState, common_prefix

log = logging.getLogger("lmspd.cache")

MAGIC = b"LMSPDKV1"
SUFFIX = ".kv"
_DIGEST = 32  # SHA-256 over header and payload, at the end of the file
# Checkpoints read ahead of their restore: how many, how many bytes in all,
# and for how long one is kept.
READ_AHEAD = 2
READ_AHEAD_BYTES = 512 << 20
READ_AHEAD_S = 60.0


@dataclass
class Checkpoint:
    path: Path
    tokens: list[int]
    kv_text: str
    visible: str | None
    response_id: str | None
    size: int
    owner: str | None = None
    floor: int = 0  # see SessionState.floor

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class DiskCheckpoints:
    def __init__(self, directory: Path, budget_bytes: int, fingerprint: str,
                 on_evict: Callable[[list[int], str], None] | None = None) -> None:
        self.directory = directory
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        # Told (tokens, owner) of each checkpoint the budget removes or refuses.
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._index: dict[str, Checkpoint] = {}
        # Checkpoints read ahead of their restore (``prefetch``), by name:
        # (when read, header, payload); taken by ``load``.
        self._read_ahead: OrderedDict[str, tuple[float, dict[str, Any], bytearray]] = OrderedDict()
        private_dir(directory)
        self._scan()

    # -- index -----------------------------------------------------------------

    def _scan(self) -> None:
        for path in self.directory.glob("*" + SUFFIX):
            header = self._read(path, header_only=True)
            if header is None:
                continue
            self._index[path.stem] = Checkpoint(
                path=path, tokens=header["tokens"], kv_text=header["kv_text"],
                visible=header.get("visible"), response_id=header.get("response_id"), size=path.stat().st_size,
                owner=header.get("owner"), floor=header.get("floor", 0),
            )
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut off by a crash
        self._evict()  # the budget may have been lowered since they were written

    @property
    def total_bytes(self) -> int:
        # Read on the event loop (/health, /metrics), while the writer thread
        # adds and evicts: unlocked, the sum raised "dictionary changed size
        # during iteration" and failed the request.
        with self._lock:
            return sum(c.size for c in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    def _entries(self, owner: str) -> list[Checkpoint]:
        """A snapshot of ``owner``'s checkpoints (the writer thread adds others)."""
        with self._lock:
            return [cp for cp in self._index.values() if cp.owner == owner]

    def best_match(self, text: str, owner: str, response_id: str | None = None) -> tuple[Checkpoint, str] | None:
        """The checkpoint of ``owner`` whose key is the longest prefix of ``text``.

        Returns ``(checkpoint, key_kind)``; kinds are ``response-id``,
        ``responses-visible`` and ``token-text``."""
        best: tuple[Checkpoint, str] | None = None
        for cp in self._entries(owner):
            if response_id is not None and cp.response_id == response_id and cp.visible and text.startswith(cp.visible):
                return cp, "response-id"
            for kind, key in (("responses-visible", cp.visible), ("token-text", cp.kv_text)):
                if key and text.startswith(key) and (best is None or cp.n_tokens > best[0].n_tokens):
                    best = (cp, kind)
        return best

    def longest_common(self, tokens: list[int], owner: str) -> tuple[Checkpoint, int] | None:
        """The checkpoint of ``owner`` sharing the longest token prefix with
        ``tokens`` (a branch or an edit of a saved conversation) that it can
        be cut to exactly (not below its floor, unless whole)."""
        best: tuple[Checkpoint, int] | None = None
        for cp in self._entries(owner):
            common = common_prefix(cp.tokens, tokens)
            if common < cp.n_tokens and common < cp.floor:
                continue
            if common and (best is None or common > best[1]):
                best = (cp, common)
        return best

    def prefetch(self, cp: Checkpoint) -> None:
        """Read and verify ``cp`` now (a thread other than the scheduler's),
        for the ``load`` that is likely to follow. At most ``READ_AHEAD``
        reads (``READ_AHEAD_BYTES``) are kept, none longer than ``READ_AHEAD_S``."""
        name = cp.path.stem
        with self._lock:
            self._expire_read_ahead()
            if name in self._read_ahead:
                return
        header_payload = self._read(cp.path)
        if header_payload is None:
            with self._lock:
                self._index.pop(name, None)
            return
        if len(header_payload[1]) > READ_AHEAD_BYTES:
            return  # too big to hold beside the RAM budget: the restore reads it
        with self._lock:
            if name not in self._index:
                return  # evicted meanwhile
            self._read_ahead[name] = (time.monotonic(), *header_payload)
            while (len(self._read_ahead) > READ_AHEAD
                   or sum(len(p) for _, _, p in self._read_ahead.values()) > READ_AHEAD_BYTES):
                self._read_ahead.popitem(last=False)

    def _expire_read_ahead(self) -> None:
        old = time.monotonic() - READ_AHEAD_S
        for name in [n for n, (at, _, _) in self._read_ahead.items() if at < old]:
            del self._read_ahead[name]

    def load(self, cp: Checkpoint) -> SessionState | None:
        with self._lock:
            ahead = self._read_ahead.pop(cp.path.stem, None)
        header_payload = self._read(cp.path) if ahead is None else ahead[1:]
        if header_payload is None:
            if not cp.path.exists():  # removed as unusable, or evicted meanwhile
                with self._lock:
                    self._index.pop(cp.path.stem, None)
            return None
        header, payload = header_payload
        try:
            os.utime(cp.path)  # least-recently-used bookkeeping
        except OSError:
            pass  # evicted since it was read: the state read is still exact
        return SessionState(
            tokens=header["tokens"], kv_text=header["kv_text"], visible=header.get("visible"),
            call_ids=frozenset(header.get("call_ids", [])), response_id=header.get("response_id"), kv=payload,
            owner=header.get("owner", ""), floor=header.get("floor", 0), boundary=header.get("boundary"),
            aligned=tuple((t, c) for t, c in header.get("aligned", [])), aligned_text=header.get("aligned_text", ""),
        )

    # -- writing ---------------------------------------------------------------

    def save(self, state: SessionState) -> Path | None:
        if state.kv is None:
            return None
        name = state.key
        header = json.dumps({
            "fingerprint": self.fingerprint,
            "tokens": state.tokens,
            "kv_text": state.kv_text,
            "visible": state.visible,
            "call_ids": sorted(state.call_ids),
            "response_id": state.response_id,
            "owner": state.owner,
            "floor": state.floor,
            "boundary": state.boundary,
            "aligned": state.aligned,
            "aligned_text": state.aligned_text,
            "created": time.time(),
        }).encode()
        hasher = hashlib.sha256(header)
        hasher.update(state.kv)  # not header + kv: that copies the whole state once more
        digest = hasher.digest()
        size = len(MAGIC) + 4 + len(header) + len(state.kv) + len(digest)
        if size > self.budget_bytes:
            if self.on_evict is not None:
                self.on_evict(list(state.tokens), state.owner)
            return None
        path = self.directory / (name + SUFFIX)
        # A temp file of this write's own: the writer thread and a save the
        # scheduler makes itself (back-pressure, shutdown) may write one key
        # at once.
        fd, tmp = tempfile.mkstemp(prefix=name + "-", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), FILE_MODE)  # 0600 whatever the umask: it holds the prompt's text
                fh.write(MAGIC)
                fh.write(struct.pack("<I", len(header)))
                fh.write(header)
                fh.write(state.kv)
                fh.write(digest)
                fh.flush()
                os.fsync(fh.fileno())
            with self._lock:  # the last rename wins, and the index describes its file
                os.replace(tmp, path)
                self._index[name] = Checkpoint(path=path, tokens=list(state.tokens), kv_text=state.kv_text,
                                               visible=state.visible, response_id=state.response_id, size=size,
                                               owner=state.owner, floor=state.floor)
                self._read_ahead.pop(name, None)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._evict()
        return path

    def _evict(self) -> None:
        """Within the budget again: the least recently used checkpoints of
        the owners over their fair share go, so that one key that saves
        without end removes only its own."""
        removed: list[Checkpoint] = []
        with self._lock:
            entries = sorted(self._index.values(), key=lambda c: _mtime(c.path))
            usage: dict[str, int] = {}
            for cp in entries:
                usage[cp.owner or ""] = usage.get(cp.owner or "", 0) + cp.size
            while over := over_share(usage, self.budget_bytes):
                cp = next(c for c in entries if (c.owner or "") in over)
                entries.remove(cp)
                cp.path.unlink(missing_ok=True)
                self._index.pop(cp.path.stem, None)
                self._read_ahead.pop(cp.path.stem, None)
                usage[cp.owner or ""] -= cp.size
                removed.append(cp)
        if self.on_evict is not None:
            for cp in removed:
                self.on_evict(list(cp.tokens), cp.owner or "")

    def _read(self, path: Path, header_only: bool = False):  # noqa: ANN202
        """Header (and payload) of a valid checkpoint; removes an invalid one."""
        try:
            with open(path, "rb") as fh:
                if fh.read(len(MAGIC)) != MAGIC:
                    raise ValueError("bad magic")
                (hlen,) = struct.unpack("<I", fh.read(4))
                header_bytes = fh.read(hlen)
                header = _checked_header(json.loads(header_bytes))
                if header.get("fingerprint") != self.fingerprint:
                    raise ValueError("checkpoint is for another model or build")
                if header_only:
                    return header
                # Read into one buffer, hashed and restored in place: every
                # copy of a state is milliseconds of the turn that waits for it.
                size = os.fstat(fh.fileno()).st_size - fh.tell() - _DIGEST
                if size < 0:
                    raise ValueError("truncated")
                payload = bytearray(size)
                if fh.readinto(payload) != size:
                    raise ValueError("truncated")
                digest = fh.read(_DIGEST)
            hasher = hashlib.sha256(header_bytes)
            hasher.update(payload)
            if hasher.digest() != digest:
                raise ValueError("checksum mismatch")
            return header, payload
        except OSError as exc:
            # Not the file's fault (too many open files, an I/O error, evicted
            # meanwhile): a valid checkpoint was deleted for it.
            log.warning("could not read KV checkpoint %s: %s", path.name, exc)
            return None
        except (ValueError, struct.error, json.JSONDecodeError) as exc:
            log.warning("removing unusable KV checkpoint %s: %s", path.name, exc)
            path.unlink(missing_ok=True)
            return None


def _checked_header(header: Any) -> dict[str, Any]:
    """``header`` if it has the fields the index reads, of their types. Read
    before the checksum (the index is built from headers alone), so a
    damaged or foreign file that parses as JSON must be refused here, not
    crash the scan or a later lookup."""
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    tokens = header.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError("header has no token list")
    if not isinstance(header.get("kv_text"), str):
        raise ValueError("header has no kv_text")
    for key in ("visible", "response_id", "owner", "fingerprint"):
        if header.get(key) is not None and not isinstance(header[key], str):
            raise ValueError(f"header's {key} is not a string")
    floor = header.get("floor", 0)
    if type(floor) is not int or floor < 0:
        raise ValueError("header's floor is not a count")
    return header


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
