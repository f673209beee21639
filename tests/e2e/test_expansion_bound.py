"""Stored history expands within a bound, off the event loop (issue 31),
against a real ``lmspd serve``: references to one 4,000,000-character
stored item, sent to /v1/responses/input_tokens (a ``responses:read``
call), are refused with a 400 naming the bound at once, while /health keeps
answering and the server's memory stays where it was. Before, each
reference was read and decoded again on the event loop: 256 of them took
37 s to fail, held /health for up to 12.9 s and grew RSS by 8.2 GiB."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from support.server import MODEL

ITEM_CHARS = 4_000_000
# Four of them are within the bound (16 MiB of characters), the fifth is not.
REFERENCES = 64


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.alone
def test_references_past_the_expansion_bound_are_refused_at_once(server):
    text = ("lorem ipsum dolor sit amet " * (ITEM_CHARS // 27 + 1))[:ITEM_CHARS]
    conv = httpx.post(server.url + "/v1/conversations", timeout=60,
                      json={"items": [{"type": "message", "role": "user", "content": text}]})
    assert conv.status_code == 200, conv.text
    items = httpx.get(server.url + f"/v1/conversations/{conv.json()['id']}/items", timeout=60).json()
    (item_id,) = [i["id"] for i in items["data"]]
    body = {"model": MODEL, "input": [{"type": "item_reference", "id": item_id}] * REFERENCES}
    # One expansion first: what a refused request may leave resident
    # (the allocator keeps what it freed) is not counted below.
    assert httpx.post(server.url + "/v1/responses/input_tokens", json=body, timeout=120).status_code == 400
    before = rss_bytes(server.proc.pid)

    health: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(server.url + "/health").status_code == 200
                health.append(time.monotonic() - started)
                time.sleep(0.005)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        elapsed = []
        for _ in range(3):
            started = time.monotonic()
            r = httpx.post(server.url + "/v1/responses/input_tokens", json=body, timeout=120)
            elapsed.append(time.monotonic() - started)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "input[4]" and "max_expanded_chars" in err["message"], err
    finally:
        done.set()
        poller.join(60)
    grown = rss_bytes(server.proc.pid) - before
    print(f"refusals took {[round(e, 3) for e in elapsed]} s; /health answered {len(health)} times, "
          f"slowest {max(health) * 1000:.1f} ms; RSS grew {grown / 2**20:.1f} MiB")
    assert max(elapsed) < 1.0, elapsed
    assert health and max(health) < 0.25, max(health)
    assert grown < 64 * 2**20, grown
