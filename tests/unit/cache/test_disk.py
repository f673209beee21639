"""Disk checkpoints: atomic, checksummed, budgeted, and never loaded when wrong."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmspd.cache.disk import MAGIC, DiskCheckpoints
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


def test_a_checkpoint_that_cannot_be_opened_for_now_is_kept(tmp_path, monkeypatch):
    """Any OSError reading it (too many open files, an I/O error) deleted a
    valid checkpoint, and dropped it from the index."""
    import builtins
    import errno

    disk = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    path = disk.save(state("hello", 5))
    cp, _ = disk.best_match("hello!", "local")
    real_open = builtins.open

    def no_descriptors(file, *args, **kwargs):
        if str(file) == str(path):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_descriptors)
    assert disk.load(cp) is None
    monkeypatch.setattr(builtins, "open", real_open)
    assert path.exists()
    cp, _ = disk.best_match("hello!", "local")
    assert disk.load(cp).kv_text == "hello"


def test_other_model_or_garbage_is_ignored_and_removed(tmp_path):
    DiskCheckpoints(tmp_path, 10 << 20, "model-a").save(state("hello", 5))
    (tmp_path / "junk.kv").write_bytes(b"not a checkpoint")
    (tmp_path / "half.tmp").write_bytes(b"cut off by a crash")
    disk = DiskCheckpoints(tmp_path, 10 << 20, "model-b")
    assert len(disk) == 0
    assert list(tmp_path.iterdir()) == []


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.fixed_dictionaries({}, optional={
    "tokens": st.one_of(JSON, st.lists(st.integers(0, 9), max_size=6)), "kv_text": JSON, "visible": JSON,
    "response_id": JSON, "owner": st.one_of(JSON, st.just("local")), "floor": JSON})


def write_checkpoint(path, header: dict | object) -> None:
    """A file with the right magic and a checksum over whatever header it holds."""
    head = json.dumps(header).encode()
    payload = b"kvbytes"
    path.write_bytes(MAGIC + struct.pack("<I", len(head)) + head + payload + hashlib.sha256(head + payload).digest())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.one_of(JSON, FIELDS.map(lambda h: {**h, "fingerprint": "fp"})))
def test_a_checkpoint_whose_header_is_any_json_is_indexed_only_when_whole(tmp_path_factory, header):
    """Headers are read before the checksum (the index is built from them
    alone): a list, a missing token list or ``"tokens": null`` crashed the
    scan, or was indexed and crashed the planner's lookup later."""
    directory = tmp_path_factory.mktemp("kv")
    write_checkpoint(directory / "x.kv", header)
    disk = DiskCheckpoints(directory, 10 << 20, "fp")
    kept = len(disk) == 1
    assert kept == (directory / "x.kv").exists()
    if kept:
        assert isinstance(header, dict) and isinstance(header["tokens"], list) and isinstance(header["kv_text"], str)
    disk.longest_common([1, 2, 3], "local")
    disk.best_match("abc", "local", response_id="r")


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


def test_a_key_within_its_fair_share_keeps_its_checkpoint_while_another_floods(tmp_path):
    """The budget is shared max-min fairly (lmspd.core.fairness): bob's ten
    checkpoints remove only bob's least recently used, never alice's one,
    which is older than all of them but within an equal split."""
    kv = b"x" * 4000
    disk = DiskCheckpoints(tmp_path, 20_000, "fp")
    alice = state("alice's", 1, kv)
    alice.owner = "alice"
    path = disk.save(alice)
    os.utime(path, (1, 1))
    for i in range(10):
        bob = state(f"bob's {i}", 2 + i, kv)
        bob.owner = "bob"
        os.utime(disk.save(bob), (10 + i, 10 + i))
    assert disk.total_bytes <= 20_000
    assert path.exists() and disk.best_match("alice's turn", "alice") is not None
    assert disk.best_match("bob's 9", "bob") is not None and disk.best_match("bob's 0", "bob") is None


def test_a_budget_lowered_between_runs_holds_from_the_start(tmp_path):
    kv = b"x" * 4000
    disk = DiskCheckpoints(tmp_path, 100_000, "fp")
    for i in range(8):
        os.utime(disk.save(state(f"turn {i}", 1 + i, kv)), (i, i))
    assert disk.total_bytes > 20_000
    again = DiskCheckpoints(tmp_path, 20_000, "fp")
    assert again.total_bytes <= 20_000
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kv")) == again.total_bytes
    assert again.best_match("turn 7", "local") is not None and again.best_match("turn 0", "local") is None


def test_two_saves_of_one_key_at_once_leave_a_whole_checkpoint(tmp_path):
    """The writer thread and a save of the scheduler's own (back-pressure,
    shutdown) may write one key together: each writes a temp file of its
    own, the last rename wins, and what is left loads."""
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    errors: list[BaseException] = []

    def save(s: SessionState) -> None:
        try:
            disk.save(s)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    for trial in range(30):
        one, other = state("abc", 3, b"1" * 2_000_000), state("abc", 3, b"2" * 2_000_000)
        other.visible = "another visible " * 50
        threads = [threading.Thread(target=save, args=(s,)) for s in (one, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], trial
        loaded = disk.load(disk._index[one.key])
        assert loaded is not None, trial
        assert (loaded.kv, loaded.visible) in ((one.kv, one.visible), (other.kv, other.visible)), trial
        assert disk.best_match(loaded.visible, "local")[1] == "responses-visible", "the index names the file's state"
    assert [p.name for p in tmp_path.iterdir()] == [one.key + ".kv"]


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


def count_reads(disk: DiskCheckpoints) -> list[str]:
    """Names of the checkpoint files ``disk`` reads whole from now on."""
    reads: list[str] = []
    original = disk._read

    def read(path, header_only=False):
        if not header_only:
            reads.append(path.stem)
        return original(path, header_only)

    disk._read = read  # type: ignore[method-assign]
    return reads


def test_a_prefetched_checkpoint_is_loaded_without_reading_it_again(tmp_path):
    disk = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    disk.save(state("abcd", 4, kv=b"state" * 1000))
    reads = count_reads(disk)
    cp, _ = disk.best_match("abcdef", "local")
    disk.prefetch(cp)
    disk.prefetch(cp)  # read once
    assert len(reads) == 1
    loaded = disk.load(cp)
    assert loaded.kv == b"state" * 1000 and len(reads) == 1
    disk.load(cp)  # a read ahead serves one load
    assert len(reads) == 2


def test_read_ahead_is_bounded_and_forgets_evicted_checkpoints(tmp_path, monkeypatch):
    import lmspd.cache.disk as disk_module

    kv = b"x" * 4000
    disk = DiskCheckpoints(tmp_path, 13_000, "fp")  # three fit
    for name, n in (("a", 1), ("b", 2), ("c", 3)):
        os.utime(disk.save(state(name, n, kv)), (10 - n, 10 - n))  # "c" is the oldest use
    assert len(disk) == 3
    for name in "abc":
        disk.prefetch(disk.best_match(name, "local")[0])
    assert len(disk._read_ahead) == disk_module.READ_AHEAD
    ahead = set(disk._read_ahead)
    disk.save(state("d", 4, kv))  # over budget: the oldest goes, and so does its read ahead
    gone = ahead - {cp.path.stem for cp in disk._index.values()}
    assert gone and not gone & set(disk._read_ahead)
    monkeypatch.setattr(disk_module, "READ_AHEAD_S", -1.0)
    disk.prefetch(disk.best_match("d", "local")[0])  # expires every older read ahead
    assert len(disk._read_ahead) == 1


def test_a_read_ahead_too_big_to_hold_is_not_kept(tmp_path, monkeypatch):
    import lmspd.cache.disk as disk_module

    monkeypatch.setattr(disk_module, "READ_AHEAD_BYTES", 1000)
    disk = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    disk.save(state("big", 3, b"x" * 1001))
    disk.save(state("small", 5, b"y" * 600))
    disk.prefetch(disk.best_match("big", "local")[0])
    assert not disk._read_ahead
    disk.prefetch(disk.best_match("small", "local")[0])
    assert len(disk._read_ahead) == 1
    assert disk.load(disk.best_match("big", "local")[0]).kv == b"x" * 1001  # read when restored


def test_alignment_points_survive_the_disk(tmp_path):
    saved = state("abcd", 4)
    saved.aligned, saved.aligned_text = ((1, 2), (3, 4)), "abcd"
    disk = DiskCheckpoints(tmp_path, 10 << 20, "fp")
    disk.save(saved)
    loaded = disk.load(disk.best_match("abcdef", "local")[0])
    assert loaded.aligned == ((1, 2), (3, 4)) and loaded.aligned_text == "abcd"


def test_the_disk_total_is_summed_under_the_lock_the_writer_thread_takes(tmp_path):
    """``total_bytes`` is read on the event loop (/health, /metrics) while the
    KV writer thread adds and evicts checkpoints: summed unlocked, it raised
    "dictionary changed size during iteration" and failed the request."""
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    held: list[bool] = []

    class Watched(dict):
        def values(self):
            held.append(disk._lock.locked())
            return super().values()

    disk._index = Watched(disk._index)
    assert disk.total_bytes == 0
    assert held == [True]
