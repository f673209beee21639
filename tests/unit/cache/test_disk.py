"""Disk checkpoints: atomic, checksummed, budgeted, and never loaded when wrong."""

from __future__ import annotations

import os

from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.state import SessionState


def state(text: str, n: int, kv: bytes = b"kv" * 100) -> SessionState:
    return SessionState(tokens=list(range(n)), kv_text=text, visible=text + "|", call_ids=frozenset({"c1"}),
                        response_id="resp_1", kv=kv)


def test_round_trip_and_longest_prefix(tmp_path):
    disk = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    disk.save(state("ab", 2))
    disk.save(state("abcd", 4))
    cp, kind = disk.best_match("abcdef", "local")
    assert cp.n_tokens == 4 and kind == "token-text"
    loaded = disk.load(cp)
    assert loaded.tokens == [0, 1, 2, 3] and loaded.kv == b"kv" * 100 and loaded.call_ids == {"c1"}
    cp, kind = disk.best_match("abcd|more", "local", response_id="resp_1")
    assert kind == "response-id"
    assert disk.best_match("zzz", "local") is None


def test_survives_reopen(tmp_path):
    DiskCheckpoints(tmp_path, 10 << 20, "fp").save(state("hello", 5))
    again = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    assert len(again) == 1 and again.load(again.best_match("hello world", "local")[0]).kv_text == "hello"


def test_corrupt_file_is_removed_not_loaded(tmp_path):
    disk = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    path = disk.save(state("hello", 5))
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # flip a payload byte: the checksum no longer matches
    path.write_bytes(bytes(data))
    cp, _ = disk.best_match("hello!", "local")
    assert disk.load(cp) is None
    assert not path.exists()


def test_other_model_or_garbage_is_ignored_and_removed(tmp_path):
    DiskCheckpoints(tmp_path, 10 << 20, "model-a").save(state("hello", 5))
    (tmp_path / "junk.kv").write_bytes(b"not a checkpoint")
    (tmp_path / "half.tmp").write_bytes(b"cut off by a crash")
    disk = DiskCheckpoints(tmp_path, 10 << 20, "model-b")
    assert len(disk) == 0
    assert list(tmp_path.iterdir()) == []


def test_budget_evicts_least_recently_used(tmp_path):
    kv = b"x" * 4000
    disk = DiskCheckpoints(tmp_path, 10_000, "fp")
    first = disk.save(state("a", 1, kv))
    second = disk.save(state("b", 2, kv))
    os.utime(first, (1, 1))  # "a" is the oldest use
    os.utime(second, (2, 2))
    disk.load(disk.best_match("b", "local")[0])  # touching "b" makes it recent
    disk.save(state("c", 3, kv))
    assert disk.total_bytes <= 10_000
    assert disk.best_match("a", "local") is None and disk.best_match("b", "local") is not None and disk.best_match("c", "local") is not None


def test_checkpoints_match_only_their_owners_requests(tmp_path):
    disk = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    mine = state("secret prompt", 5)
    mine.owner = "key_alice"
    disk.save(mine)
    assert disk.best_match("secret prompt and more", "key_bob") is None
    assert disk.longest_common(list(range(8)), "key_bob") is None
    assert disk.best_match("secret prompt and more", "key_alice") is not None
    again = DiskCheckpoints(tmp_path, 10 << 20, "fp")  # the owner survives a restart
    cp, _ = again.best_match("secret prompt and more", "key_alice")
    assert again.load(cp).owner == "key_alice" and again.best_match("secret prompt", "key_bob") is None
